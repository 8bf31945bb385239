// The playground: streams through the server's own /v1 endpoints. Model output is untrusted: it is
// rendered as markdown whose raw HTML is shown as text (never parsed), and what marked produces is
// sanitized by DOMPurify before it reaches the page.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, messages: [], controller: null };

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}
marked.use({ gfm: true, breaks: true, renderer: { html: (token) => escapeHtml(token.text) } });
const renderMarkdown = (text) => DOMPurify.sanitize(marked.parse(text));

// ---- settings -------------------------------------------------------------------------------------

function numberSetting(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

function jsonSetting(id, what) {
  const text = $(id).value.trim();
  if (!text) return undefined;
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new Error(`${what}: not valid JSON (${e.message})`);
  }
}

function requestBody(mode) {
  const body = { model: state.model, stream: true, stream_options: { include_usage: true } };
  for (const name of ["temperature", "max_tokens", "top_p", "top_k", "min_p", "seed"]) {
    const value = numberSetting(name);
    if (value !== undefined) body[name] = value;
  }
  const stops = $("stop_strings").value.split("\n").filter((s) => s !== "");
  if (stops.length) body.stop = stops;
  if (mode === "completion") {
    body.prompt = state.messages.at(-2).content;
    return body;
  }
  const system = $("system").value.trim();
  body.messages = [...(system ? [{ role: "system", content: system }] : []),
    ...state.messages.slice(0, -1).map((m) => (m.toolCalls.length
      ? { role: "assistant", content: m.content || null, tool_calls: m.toolCalls }
      : { role: m.role, content: m.content }))];
  const schema = jsonSetting("schema", "JSON schema");
  if (schema !== undefined) {
    body.response_format = { type: "json_schema", json_schema: { name: "reply", schema, strict: true } };
  }
  const tools = jsonSetting("tools", "Tools");
  if (tools !== undefined) body.tools = tools;
  return body;
}

// ---- the conversation ------------------------------------------------------------------------------

function newMessage(role, content = "") {
  return { role, content, toolCalls: [], finish: null, tokens: null, seconds: null, ttft: null, raw: false };
}

function button(label, onClick, title) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  if (title) b.title = title;
  b.addEventListener("click", onClick);
  return b;
}

function fillMessage(el, message, index) {
  const generated = message.role === "assistant" || message.role === "completion";
  el.className = `message ${message.role}${message === state.streaming ? " streaming" : ""}`;
  el.replaceChildren();
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role;
  const content = document.createElement("div");
  content.className = "content";
  if (message.raw || !generated) {
    content.classList.add(generated ? "raw" : "plain");
    content.textContent = message.content;
  } else {
    content.innerHTML = renderMarkdown(message.content);
  }
  el.append(role, content);
  for (const call of message.toolCalls) {
    const pre = document.createElement("pre");
    pre.className = "tool-call";
    pre.textContent = `tool call ${call.function.name}(${call.function.arguments})`;
    el.append(pre);
  }
  if (generated && message !== state.streaming) {
    const stats = document.createElement("div");
    stats.className = "stats";
    const parts = [];
    if (message.tokens !== null) parts.push(`${message.tokens} tokens`);
    if (message.tokens > 1 && message.seconds > 0) parts.push(`${((message.tokens - 1) / message.seconds).toFixed(1)} tokens/s`);
    if (message.ttft !== null) parts.push(`first token ${message.ttft.toFixed(2)} s`);
    if (message.finish) parts.push(`finish: ${message.finish}`);
    stats.textContent = parts.join(" · ");
    el.append(stats);
  }
  if (message === state.streaming) return;
  const actions = document.createElement("div");
  actions.className = "actions";
  if (generated) {
    actions.append(button(message.raw ? "Rendered" : "Raw", () => { message.raw = !message.raw; render(); },
      "show the text as the model wrote it"));
    actions.append(button("Copy", () => navigator.clipboard.writeText(message.content)));
    if (index === state.messages.length - 1 && !state.controller) actions.append(button("Regenerate", regenerate));
  } else if (!state.controller) {
    actions.append(button("Edit", () => edit(index), "edit this message and drop what follows it"));
  }
  el.append(actions);
}

function render() {
  const box = $("messages");
  box.replaceChildren(...state.messages.map((message, i) => {
    const el = document.createElement("article");
    fillMessage(el, message, i);
    message.el = el;
    return el;
  }));
  box.scrollTop = box.scrollHeight;
}

let pendingFrame = 0;
function renderStreaming() {   // at most once per animation frame: re-parsing markdown per token adds up
  if (pendingFrame) return;
  pendingFrame = requestAnimationFrame(() => {
    pendingFrame = 0;
    const message = state.streaming;
    if (!message) return;
    fillMessage(message.el, message, state.messages.indexOf(message));
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  });
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function showError(text) { $("error").textContent = text || ""; }

// ---- generation ------------------------------------------------------------------------------------

function applyChunk(message, chunk, started) {
  if (chunk.usage) message.tokens = chunk.usage.completion_tokens;
  for (const choice of chunk.choices || []) {
    const text = choice.text ?? choice.delta?.content ?? "";
    const calls = choice.delta?.tool_calls || [];
    if ((text || calls.length) && message.ttft === null) {
      message.ttft = (performance.now() - started) / 1000;
      message.firstAt = performance.now();
    }
    message.content += text;
    for (const call of calls) {
      const slot = message.toolCalls[call.index] ||= { id: call.id, type: "function", function: { name: "", arguments: "" } };
      if (call.id) slot.id = call.id;
      slot.function.name += call.function?.name || "";
      slot.function.arguments += call.function?.arguments || "";
    }
    if (choice.finish_reason) message.finish = choice.finish_reason;
    if (text || calls.length) message.lastAt = performance.now();
  }
}

async function generate() {
  const mode = $("mode").value;
  const message = newMessage(mode === "chat" ? "assistant" : "completion");
  state.messages.push(message);
  let body;
  try {
    body = requestBody(mode);
  } catch (e) {
    state.messages.pop();
    showError(e.message);
    return;
  }
  showError("");
  state.streaming = message;
  state.controller = new AbortController();
  setBusy(true);
  render();
  const started = performance.now();
  try {
    const response = await tm.fetch(mode === "chat" ? "v1/chat/completions" : "v1/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await tm.errorMessage(response));
    await tm.readEvents(response, (event, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      applyChunk(message, chunk, started);
      renderStreaming();
    });
  } catch (e) {
    if (e.name === "AbortError") message.finish = "stopped";
    else showError(e.message);
    if (!message.content && !message.toolCalls.length && e.name !== "AbortError") state.messages.pop();
  } finally {
    if (message.firstAt && message.lastAt) message.seconds = (message.lastAt - message.firstAt) / 1000;
    state.streaming = null;
    state.controller = null;
    setBusy(false);
    render();
  }
}

function send(event) {
  event?.preventDefault();
  if (state.controller) return;
  const text = $("input").value;
  if (!text.trim()) return;
  if (!state.model) { showError("not connected to the server yet"); return; }
  state.messages.push(newMessage($("mode").value === "chat" ? "user" : "prompt", text));
  $("input").value = "";
  generate();
}

function regenerate() {
  if (state.controller) return;
  state.messages.pop();
  generate();
}

function edit(index) {
  $("input").value = state.messages[index].content;
  state.messages.splice(index);
  render();
  $("input").focus();
}

// ---- wiring ----------------------------------------------------------------------------------------

$("composer").addEventListener("submit", send);
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
});
$("stop").addEventListener("click", () => state.controller?.abort());
document.addEventListener("keydown", (e) => { if (e.key === "Escape" && state.controller) state.controller.abort(); });
$("clear").addEventListener("click", () => { if (!state.controller) { state.messages = []; render(); showError(""); } });
$("mode").addEventListener("change", () => {
  document.body.classList.toggle("completion", $("mode").value === "completion");
  $("input").placeholder = $("mode").value === "chat" ? "Message (Enter sends, Shift+Enter adds a line)"
    : "Prompt to continue (Enter sends, Shift+Enter adds a line)";
});
$("settings-toggle").addEventListener("click", () => {
  const open = $("settings").classList.toggle("open");
  $("settings-toggle").setAttribute("aria-expanded", String(open));
});
tm.initKeyButton();

(async () => {
  try {
    state.model = await tm.modelName();
    $("model").textContent = state.model ? `model: ${state.model}` : "no API key";
  } catch (e) {
    $("model").textContent = "server unreachable";
    showError(e.message);
  }
  $("input").focus();
})();
