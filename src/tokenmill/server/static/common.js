// tokenmill web UI: what both pages share. The API key, when the server has one, is asked for once
// and kept in sessionStorage: this tab only, gone when the tab closes, never sent anywhere but here.
"use strict";

const KEY_STORAGE = "tokenmill-api-key";

const tm = {
  apiKey() { return sessionStorage.getItem(KEY_STORAGE) || ""; },

  headers(extra = {}) {
    const key = tm.apiKey();
    return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
  },

  // fetch with the key; on 401 asks for a key and tries again (until the user cancels).
  async fetch(path, options = {}) {
    for (;;) {
      const response = await fetch(path, { ...options, headers: tm.headers(options.headers || {}) });
      if (response.status !== 401) return response;
      const message = await tm.errorMessage(response);
      if (!(await tm.askKey(tm.apiKey() ? `That key was refused: ${message}` : "This server needs an API key."))) {
        return response;
      }
    }
  },

  // The message of an OpenAI-style error body (or the status line).
  async errorMessage(response) {
    try {
      const body = await response.clone().json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (e) { /* not JSON */ }
    return `HTTP ${response.status} ${response.statusText}`;
  },

  // The key dialog (made on first use: one definition for both pages).
  keyDialog() {
    let dialog = document.getElementById("key-dialog");
    if (dialog) return dialog;
    dialog = document.createElement("dialog");
    dialog.id = "key-dialog";
    dialog.innerHTML = `<form method="dialog"><strong>API key</strong><span class="reason muted"></span>
      <label>Key (kept in this tab only) <input type="password" autocomplete="off" name="key"></label>
      <div class="buttons"><button value="cancel" formnovalidate>Cancel</button>
        <button value="save" class="primary">Save</button></div></form>`;
    // Enter in the field saves (the form's implicit submission would press its first button: Cancel).
    dialog.querySelector("input").addEventListener("keydown", (e) => {
      if (e.key === "Enter") { e.preventDefault(); dialog.close("save"); }
    });
    document.body.append(dialog);
    return dialog;
  },

  // Shows the key dialog; resolves true once a key was saved, false if cancelled.
  askKey(reason) {
    const dialog = tm.keyDialog();
    const input = dialog.querySelector("input");
    dialog.querySelector(".reason").textContent = reason || "";
    input.value = tm.apiKey();
    return new Promise((resolve) => {
      dialog.onclose = () => {
        if (dialog.returnValue === "save" && input.value.trim()) {
          sessionStorage.setItem(KEY_STORAGE, input.value.trim());
          resolve(true);
        } else {
          resolve(false);
        }
      };
      dialog.showModal();
      input.focus();
    });
  },

  // Reads a server-sent-events body: onEvent(eventName, data) for each event. Resolves at its end.
  async readEvents(response, onEvent) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let event = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) event = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) onEvent(event, data.join("\n"));
      }
    }
  },

  // The served model's name (null when the key is missing or wrong).
  async modelName() {
    const response = await tm.fetch("v1/models");
    if (!response.ok) return null;
    const body = await response.json();
    return body.data[0].id;
  },

  initKeyButton() {
    document.getElementById("key-button").addEventListener("click", async () => {
      if (await tm.askKey("")) location.reload();
    });
  },
};

// One colour per request id, stable across frames and pages.
function requestColor(id) {
  let h = 2166136261;
  for (let i = 0; i < id.length; i++) h = Math.imul(h ^ id.charCodeAt(i), 16777619);
  const hue = (h >>> 0) % 360;
  const dark = matchMedia("(prefers-color-scheme: dark)").matches;
  return `hsl(${hue} 65% ${dark ? 58 : 48}%)`;
}
