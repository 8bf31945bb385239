// The engine, live: draws the frames of GET /engine/feed (documented in docs/ARCHITECTURE.md).
"use strict";

const $ = (id) => document.getElementById(id);
const FREE = -1, CACHED_FREE = -2;
const HISTORY = 400;            // time-series points kept (frames)
const STEPS_SHOWN = 160;        // bars in the steps chart
const TIMELINE_S = 60;          // seconds of request timeline
const TIMELINE_ROWS = 40;

const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
const fmt = (x, digits = 0) => (x === null || x === undefined || Number.isNaN(x) ? "–" : x.toFixed(digits));

const view = {
  frame: null,
  owner: new Int32Array(0),
  refs: new Int32Array(0),
  frames: [],                   // {time, counters, now, latency} of recent frames
  steps: [],                    // recent step records
  requests: new Map(),          // id -> {id, segments: [[t0, t1, phase]], end, reason}
};

function runLengthDecode(pairs, length) {
  const out = new Int32Array(length);
  let at = 0;
  for (let i = 0; i < pairs.length; i += 2) {
    out.fill(pairs[i], at, at + pairs[i + 1]);
    at += pairs[i + 1];
  }
  return out;
}

// A canvas sized to its box at the device's pixel ratio; returns its 2D context in CSS pixels.
function sizedCanvas(canvas, height) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    canvas.style.height = `${height}px`;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  return { ctx, width };
}

// ---- the block grid ----------------------------------------------------------------------------------

function gridLayout(width, n) {
  const cell = Math.max(4, Math.min(18, Math.floor(Math.sqrt((width * 320) / Math.max(n, 1)))));
  const cols = Math.max(1, Math.floor(width / cell));
  return { cell, cols, rows: Math.ceil(n / cols) };
}

function drawGrid() {
  const f = view.frame;
  const canvas = $("grid");
  const n = view.owner.length;
  const { cell, cols, rows } = gridLayout(canvas.clientWidth, n);
  const { ctx } = sizedCanvas(canvas, Math.max(cell, rows * cell));
  const colors = { [FREE]: css("--free"), [CACHED_FREE]: css("--cached") };
  const gap = cell >= 8 ? 1 : 0;
  ctx.font = `${Math.floor(cell * 0.62)}px system-ui, sans-serif`;
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  let used = 0, shared = 0, cached = 0, free = 0;
  for (let b = 0; b < n; b++) {
    const o = view.owner[b];
    const x = (b % cols) * cell, y = Math.floor(b / cols) * cell;
    if (o >= 0) {
      used++;
      ctx.fillStyle = requestColor(f.requests[o].id);
    } else {
      if (o === CACHED_FREE) cached++; else free++;
      ctx.fillStyle = colors[o];
    }
    ctx.fillRect(x, y, cell - gap, cell - gap);
    if (view.refs[b] > 1) {
      shared++;
      ctx.fillStyle = "#fff";
      if (cell >= 12) ctx.fillText(String(view.refs[b]), x + (cell - gap) / 2, y + (cell - gap) / 2 + 1);
      else ctx.fillRect(x + cell / 2 - 1, y + cell / 2 - 1, 2, 2);
    }
  }
  $("n-used").textContent = used;
  $("n-shared").textContent = shared;
  $("n-cached").textContent = cached;
  $("n-free").textContent = free;
  $("n-total").textContent = n;
  canvas.setAttribute("aria-label", `KV block pool: ${used} of ${n} blocks in use, ${shared} shared, ${cached} evictable`);
}

$("grid").addEventListener("mousemove", (e) => {
  if (!view.frame) return;
  const canvas = $("grid");
  const { cell, cols } = gridLayout(canvas.clientWidth, view.owner.length);
  const rect = canvas.getBoundingClientRect();
  const b = Math.floor((e.clientY - rect.top) / cell) * cols + Math.floor((e.clientX - rect.left) / cell);
  if (b < 0 || b >= view.owner.length) return;
  const o = view.owner[b];
  const who = o >= 0 ? `held by ${view.frame.requests[o].id}` : o === CACHED_FREE ? "free, holds a cached prefix" : "free";
  $("grid-hover").textContent = `block ${b}: ${who}${view.refs[b] > 1 ? ` (shared by ${view.refs[b]} requests)` : ""}`;
});

// ---- steps ---------------------------------------------------------------------------------------------

function drawSteps() {
  const canvas = $("steps");
  const height = 160;
  const { ctx, width } = sizedCanvas(canvas, height);
  const steps = view.steps.slice(-STEPS_SHOWN);
  if (!steps.length) return;
  const budget = steps.at(-1).budget;
  const top = Math.max(budget, ...steps.map((s) => s.prefill_tokens + s.decode_tokens)) * 1.05;
  const maxTime = Math.max(...steps.map((s) => s.duration)) * 1.1;
  const bar = width / STEPS_SHOWN;
  const y = (tokens) => height - (tokens / top) * height;
  steps.forEach((s, i) => {
    const x = width - (steps.length - i) * bar;
    ctx.fillStyle = css("--decode");
    ctx.fillRect(x, y(s.decode_tokens), Math.max(1, bar - 1), height - y(s.decode_tokens));
    ctx.fillStyle = css("--prefill");
    ctx.fillRect(x, y(s.decode_tokens + s.prefill_tokens), Math.max(1, bar - 1), y(s.decode_tokens) - y(s.decode_tokens + s.prefill_tokens));
  });
  ctx.strokeStyle = css("--muted");
  ctx.setLineDash([4, 3]);
  ctx.beginPath();
  ctx.moveTo(0, y(budget));
  ctx.lineTo(width, y(budget));
  ctx.stroke();
  ctx.setLineDash([]);
  ctx.strokeStyle = css("--ok");
  ctx.beginPath();
  steps.forEach((s, i) => {
    const x = width - (steps.length - i - 0.5) * bar;
    const ty = height - (s.duration / maxTime) * height;
    if (i === 0) ctx.moveTo(x, ty); else ctx.lineTo(x, ty);
  });
  ctx.stroke();
  const last = steps.at(-1);
  $("last-step").textContent = `step ${last.step}: ${(last.duration * 1000).toFixed(1)} ms; ` +
    `prefill ${last.prefill_tokens} tokens in ${last.prefill_chunks} chunk(s) + ${last.decode_tokens} decode tokens ` +
    `(${last.decodes} requests) of a ${last.budget}-token budget; ${last.running} running, ${last.waiting} waiting` +
    (last.preempted ? `; ${last.preempted} preempted` : "") + ` (step time: green line, top = ${(maxTime * 1000).toFixed(0)} ms)`;
}

// ---- time series ---------------------------------------------------------------------------------------

function recentFrames(seconds) {   // [the oldest frame within `seconds` of the latest, the latest]
  const frames = view.frames;
  const last = frames.at(-1);
  let first = last;
  for (let i = frames.length - 2; i >= 0 && last.time - frames[i].time <= seconds; i--) first = frames[i];
  return [first, last];
}

function rate(key) {      // per second over the last ~2 s of frames
  const [first, last] = recentFrames(2.0);
  if (first === last) return 0;
  return (last.counters[key] - first.counters[key]) / (last.time - first.time);
}

function hitRate() {      // prefix-cache hits / queries over the last ~5 s of frames (0 with no admissions)
  const [first, last] = recentFrames(5.0);
  const q = last.counters.prefix_cache_queries - first.counters.prefix_cache_queries;
  return q > 0 ? (100 * (last.counters.prefix_cache_hits - first.counters.prefix_cache_hits)) / q : 0;
}

const charts = {};
function makeChart(id, series) {
  const el = $(id);
  const opts = {
    width: el.clientWidth || 400, height: 200,
    series: [{}, ...series.map(([label, color, dash]) => ({ label, stroke: css(color), width: 1.5, dash, spanGaps: false }))],
    axes: [{ stroke: css("--muted"), grid: { stroke: css("--border") } },
           { stroke: css("--muted"), grid: { stroke: css("--border") }, size: 55 }],
    scales: { x: { time: true } },
    legend: { live: false },
  };
  const data = [[], ...series.map(() => [])];
  charts[id] = { plot: new uPlot(opts, data, el), data };
}

function pushChart(id, t, values) {
  const chart = charts[id];
  chart.data[0].push(t);
  values.forEach((v, i) => chart.data[i + 1].push(v));
  if (chart.data[0].length > HISTORY) chart.data.forEach((a) => a.shift());
  chart.plot.setData(chart.data);
}

function initCharts() {
  makeChart("chart-tps", [["output", "--decode"], ["prompt", "--prefill"]]);
  makeChart("chart-latency", [["TTFT p50", "--prefill"], ["TTFT p99", "--prefill", [4, 3]],
    ["ITL p50", "--decode"], ["ITL p99", "--decode", [4, 3]]]);
  makeChart("chart-kv", [["KV in use", "--decode"], ["prefix hit rate", "--ok"]]);
  makeChart("chart-requests", [["running", "--decode"], ["waiting", "--queued"], ["preempted", "--preempted"]]);
  new ResizeObserver(() => {
    for (const id in charts) charts[id].plot.setSize({ width: $(id).clientWidth, height: 200 });
  }).observe($("engine"));
}

// ---- requests ------------------------------------------------------------------------------------------

function trackRequests(f) {
  const prevTime = view.frames.length > 1 ? view.frames.at(-2).time : f.time;
  for (const r of f.requests) {
    let rec = view.requests.get(r.id);
    if (!rec) {
      rec = { id: r.id, arrival: r.arrival, segments: [[r.arrival, prevTime, "queued"]], end: null, reason: null };
      view.requests.set(r.id, rec);
    }
    const phase = { running: "decode", waiting: "queued" }[r.phase] || r.phase;
    const lastSeg = rec.segments.at(-1);
    if (lastSeg[2] === phase) lastSeg[1] = f.time;
    else rec.segments.push([lastSeg[1], f.time, phase]);
  }
  for (const done of f.finished) {
    const rec = view.requests.get(done.id);
    if (rec) { rec.end = f.time; rec.reason = done.reason; }
  }
  for (const [id, rec] of view.requests) {       // forget what left the timeline
    if ((rec.end ?? f.time) < f.time - TIMELINE_S) view.requests.delete(id);
  }
}

function drawTimeline(now) {
  const canvas = $("timeline");
  const recs = [...view.requests.values()].sort((a, b) => a.arrival - b.arrival).slice(-TIMELINE_ROWS);
  const rowH = 8;
  const height = Math.max(40, recs.length * rowH + 16);
  const { ctx, width } = sizedCanvas(canvas, height);
  const x = (t) => width - ((now - t) / TIMELINE_S) * width;
  const colors = { queued: css("--queued"), prefill: css("--prefill"), decode: css("--decode"), preempted: css("--preempted") };
  const ends = { stop: css("--ok"), length: css("--ok"), abort: css("--warn"), error: css("--danger") };
  recs.forEach((rec, i) => {
    const y = i * rowH;
    for (const [t0, t1, phase] of rec.segments) {
      ctx.fillStyle = colors[phase] || colors.decode;
      ctx.fillRect(x(t0), y, Math.max(1, x(t1) - x(t0)), rowH - 2);
    }
    if (rec.end) {
      ctx.fillStyle = ends[rec.reason] || css("--muted");
      ctx.fillRect(x(rec.end) - 1, y - 1, 4, rowH);
    }
  });
  ctx.fillStyle = css("--muted");
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "bottom";
  for (let s = 0; s <= TIMELINE_S; s += 10) {
    const label = s === 0 ? "now" : `-${s} s`;
    ctx.textAlign = s === 0 ? "right" : "center";
    ctx.fillText(label, x(now - s), height);
  }
}

function fillTable(f) {
  const body = $("requests").querySelector("tbody");
  body.replaceChildren(...f.requests.map((r) => {
    const tr = document.createElement("tr");
    const cells = [r.id, r.phase, r.prompt_tokens, `${r.output_tokens} / ${r.max_tokens}`, r.blocks, r.cached_tokens,
      r.preemptions];
    cells.forEach((value, i) => {
      const td = document.createElement("td");
      if (i === 0) {
        const dot = document.createElement("span");
        dot.className = "dot";
        dot.style.background = requestColor(r.id);
        td.append(dot);
      }
      td.append(String(value));
      tr.append(td);
    });
    return tr;
  }));
}

// ---- a frame ---------------------------------------------------------------------------------------------

function onFrame(f) {
  view.frame = f;
  view.owner = runLengthDecode(f.blocks.owner, f.config.num_kv_blocks);
  view.refs = runLengthDecode(f.blocks.refs, f.config.num_kv_blocks);
  view.frames.push({ time: f.time, counters: f.counters });
  if (view.frames.length > HISTORY) view.frames.shift();
  view.steps.push(...f.steps);
  if (view.steps.length > STEPS_SHOWN) view.steps.splice(0, view.steps.length - STEPS_SHOWN);
  trackRequests(f);

  const total = f.config.num_kv_blocks;
  const used = f.now.kv_blocks_used;
  const tps = rate("generation_tokens");
  $("c-running").textContent = f.now.running;
  $("c-waiting").textContent = f.now.waiting;
  $("c-preempted").textContent = f.now.preempted;
  $("c-kv").textContent = `${used} / ${total}`;
  $("c-hits").textContent = f.counters.prefix_cache_queries
    ? `${fmt((100 * f.counters.prefix_cache_hits) / f.counters.prefix_cache_queries, 1)}%` : "–";
  $("c-tps").textContent = fmt(tps, 1);
  $("c-step").textContent = f.step;
  $("c-preemptions").textContent = f.counters.preemptions;
  $("block-size").textContent = f.config.block_size;
  $("latency-window").textContent = f.latency.window_s;

  drawGrid();
  drawSteps();
  const lat = f.latency;
  pushChart("chart-tps", f.time, [tps, rate("prompt_tokens")]);
  pushChart("chart-latency", f.time, [lat.ttft.p50, lat.ttft.p99, lat.itl.p50, lat.itl.p99]);
  pushChart("chart-kv", f.time, [(100 * used) / total, hitRate()]);
  pushChart("chart-requests", f.time, [f.now.running, f.now.waiting, f.now.preempted]);
  drawTimeline(f.time);
  fillTable(f);
}

// ---- the feed ----------------------------------------------------------------------------------------------

function setStatus(text) { $("feed-status").textContent = text; }
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function follow() {
  for (;;) {
    try {
      const response = await tm.fetch("engine/feed");
      if (response.status === 401) { setStatus("needs an API key"); return; }
      if (!response.ok) {
        setStatus(`feed: ${await tm.errorMessage(response)}; retrying`);
      } else {
        setStatus("live");
        await tm.readEvents(response, (event, data) => { if (event === "frame") onFrame(JSON.parse(data)); });
        setStatus("feed ended; reconnecting");
      }
    } catch (e) {
      setStatus(`feed lost (${e.message}); reconnecting`);
    }
    await sleep(1000);
  }
}

// ---- break it ----------------------------------------------------------------------------------------------

$("burst-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const body = {
    requests: Number($("b-requests").value), prompt_tokens: Number($("b-prompt").value),
    output_tokens: Number($("b-output").value), shared_prefix: Number($("b-shared").value) / 100,
    temperature: Number($("b-temperature").value),
  };
  const response = await tm.fetch("engine/burst", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  if (!response.ok) { $("burst-result").textContent = await tm.errorMessage(response); return; }
  const result = await response.json();
  $("burst-result").textContent = `${result.id}: ${result.accepted} requests sent` +
    (result.rejected ? `, ${result.rejected} refused (the server's queue is full)` : "");
});

$("b-abort").addEventListener("click", async () => {
  const response = await tm.fetch("engine/burst", { method: "DELETE" });
  $("burst-result").textContent = response.ok ? `aborted ${(await response.json()).aborted} requests`
    : await tm.errorMessage(response);
});

tm.initKeyButton();
initCharts();
follow();
