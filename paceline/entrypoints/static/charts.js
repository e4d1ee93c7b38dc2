/* paceline's dashboard charts: plain 2D canvas, no dependencies, no build step.
 *
 * Live page (dashboard.html):  PacelineCharts.connect(eventsUrl, container, {status, drawn})
 * Static page (a report):      PacelineCharts.drawSteps(container, stepRecords, {info: {model: info}, now})
 *   step records are the feed's: {model, seq, t, dur, pred, decode, prefill, reqs, running, waiting, swapped,
 *   kv_used, kv_cached, kv_free, preempted, swapped_out, stalls}; t and dur in seconds, t on any clock.
 * Node (tests): module.exports is the same object; the data functions need no DOM, the draw functions take any
 * object with the CanvasRenderingContext2D methods they call.
 */
(function (root, factory) {
  const api = factory();
  if (typeof module === "object" && module.exports) module.exports = api;
  else root.PacelineCharts = api;
})(typeof self !== "undefined" ? self : this, function () {
  "use strict";

  const WINDOW_S = 60;
  const C = {
    decode: "#4e79a7", prefill: "#f28e2b", dur: "#59a14f", pred: "#b07aa1", limit: "#e15759",
    running: "#4e79a7", waiting: "#f28e2b", swapped: "#e15759",
    used: "#4e79a7", cached: "#76b7b2", free: "#dfe3e8",
    preempt: "#e15759", stall: "#9c6b00", grid: "#e6e6e6", axis: "#888", text: "#333",
    ttft: "#4e79a7", tbt: "#59a14f",
  };
  const STATES = ["running", "waiting", "swapped"];

  // ---------------------------------------------------------------- data (no DOM)

  function createStore(windowS) {
    return { windowS: windowS || WINDOW_S, models: new Map(), messages: 0, stepsDrawn: 0 };
  }

  function modelOf(store, name) {
    let m = store.models.get(name);
    if (!m) {
      m = { name, info: null, steps: [], lastSeq: 0, now: 0, state: null, history: [], latency: null };
      store.models.set(name, m);
    }
    return m;
  }

  /** Take one feed message (or a static batch shaped like one); returns the model's data. */
  function ingest(store, msg) {
    store.messages++;
    const m = modelOf(store, msg.model);
    if (msg.info) {
      if (m.info && m.info.started !== msg.info.started) {  // the server restarted: its seq counts again from 1
        m.steps = []; m.lastSeq = 0; m.history = []; m.now = 0;
      }
      m.info = msg.info;
    }
    if (typeof msg.now === "number" && msg.now > m.now) m.now = msg.now;
    for (const s of msg.steps || []) {
      if (s.seq !== undefined && s.seq <= m.lastSeq) continue;  // a reconnect sends its backlog again
      m.steps.push(s);
      if (s.seq !== undefined) m.lastSeq = s.seq;
      if (s.t > m.now) m.now = s.t;
    }
    const last = m.history[m.history.length - 1];
    if (msg.state && !(last && msg.state.t <= last.t)) {  // a reconnect resends the last snapshot
      m.state = msg.state;
      m.history.push({ t: msg.state.t, by: msg.state.by_priority });
    }
    if (msg.latency) m.latency = msg.latency;
    trim(m, store.windowS);
    return m;
  }

  function firstAtOrAfter(items, t) {  // items sorted by .t
    let lo = 0, hi = items.length;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (items[mid].t < t) lo = mid + 1; else hi = mid; }
    return lo;
  }

  function trim(m, windowS) {
    const from = m.now - windowS;
    const i = firstAtOrAfter(m.steps, from);
    if (i > 0) m.steps.splice(0, i);
    const j = firstAtOrAfter(m.history, from);
    if (j > 0) m.history.splice(0, j);
  }

  /** Per-step columns of the steps in the window, x in seconds before `now` (negative). */
  function columns(steps, now, windowS) {
    const out = { x: [], decode: [], prefill: [], dur: [], pred: [], running: [], waiting: [], swapped: [],
                  used: [], cached: [], free: [], preempt: [], stall: [] };
    for (const s of steps) {
      const x = s.t - now;
      if (x < -windowS) continue;
      out.x.push(x);
      out.decode.push(s.decode); out.prefill.push(s.prefill);
      out.dur.push(s.dur * 1000); out.pred.push(s.pred > 0 ? s.pred * 1000 : null);
      out.running.push(s.running); out.waiting.push(s.waiting); out.swapped.push(s.swapped);
      out.used.push(s.kv_used); out.cached.push(s.kv_cached); out.free.push(s.kv_free);
      if (s.preempted > 0 || s.swapped_out > 0) out.preempt.push(x);
      if (s.stalls > 0) out.stall.push(x);
    }
    return out;
  }

  /** Requests by (state, priority) over time from the snapshots: one series per pair that ever had one. */
  function priorityColumns(history, now, windowS) {
    const keys = new Map();
    for (const h of history) for (const [p, counts] of Object.entries(h.by)) for (const st of STATES)
      if (counts[st] > 0) keys.set(st + " p" + p, { state: st, priority: p });
    const order = [...keys.entries()].sort((a, b) =>
      STATES.indexOf(a[1].state) - STATES.indexOf(b[1].state) || Number(a[1].priority) - Number(b[1].priority));
    const x = [], series = order.map(([label, k], i) => ({ label, values: [], color: shade(C[k.state], k.priority, i) }));
    for (const h of history) {
      if (h.t - now < -windowS) continue;
      x.push(h.t - now);
      order.forEach(([, k], i) => series[i].values.push(((h.by[k.priority] || {})[k.state]) || 0));
    }
    return { x, series };
  }

  function shade(hex, priority, i) {  // lower priority numbers (more urgent) darker
    const n = parseInt(hex.slice(1), 16), f = Math.min(0.6, 0.15 * (Math.abs(Number(priority)) % 5));
    const mix = (c) => Math.round(c + (255 - c) * f);
    return `rgb(${mix(n >> 16)},${mix((n >> 8) & 255)},${mix(n & 255)})`;
  }

  // ---------------------------------------------------------------- drawing on a 2D context

  const M = { l: 44, r: 8, t: 38, b: 18 };  // the top margin holds the title line and the legend line

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v))), f = v / p;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 ? 2.5 : f <= 5 ? 5 : 10) * p;
  }

  function divisions(yMax) {  // round tick values: 2 -> 0.5 steps, 1, 2.5 and 5 -> fifths
    const f = yMax / Math.pow(10, Math.floor(Math.log10(yMax)));
    return Math.abs(f - 2) < 1e-9 ? 4 : 5;
  }

  function fmt(v) {
    return v >= 1000 ? (v / 1000).toFixed(v >= 10000 ? 0 : 1) + "k" : String(Math.round(v * 100) / 100);
  }

  /** Clear, draw the frame and grid; returns the scales of a time chart (x in [-windowS, 0]). */
  function frame(ctx, w, h, title, yMax, windowS, legend) {
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px sans-serif";
    ctx.textBaseline = "middle";
    const pw = w - M.l - M.r, ph = h - M.t - M.b;
    const sx = (x) => M.l + (x + windowS) / windowS * pw;
    const sy = (y) => M.t + ph - (y / yMax) * ph;
    ctx.strokeStyle = C.grid; ctx.lineWidth = 1;
    ctx.fillStyle = C.axis; ctx.textAlign = "right";
    const ticks = divisions(yMax);
    for (let k = 0; k <= ticks; k++) {
      const y = sy(yMax * k / ticks);
      ctx.beginPath(); ctx.moveTo(M.l, y); ctx.lineTo(w - M.r, y); ctx.stroke();
      ctx.fillText(fmt(yMax * k / ticks), M.l - 4, y);
    }
    ctx.textAlign = "center";
    for (let k = 0; k <= 6; k++) {
      const x = -windowS + windowS * k / 6;
      ctx.fillText(k === 6 ? "now" : Math.round(x) + "s", sx(x), h - M.b / 2);
    }
    ctx.fillStyle = C.text; ctx.textAlign = "left"; ctx.font = "bold 12px sans-serif";
    ctx.fillText(title, 4, 9);
    ctx.font = "11px sans-serif";
    let lx = M.l;
    const ly = 25;
    for (const { label, color, dash } of legend || []) {
      ctx.fillStyle = color; ctx.strokeStyle = color;
      if (dash) { ctx.setLineDash([4, 3]); ctx.beginPath(); ctx.moveTo(lx, ly); ctx.lineTo(lx + 10, ly); ctx.stroke(); ctx.setLineDash([]); }
      else ctx.fillRect(lx, ly - 4, 10, 8);
      lx += 14;
      ctx.fillStyle = C.text; ctx.fillText(label, lx, ly);
      lx += ctx.measureText(label).width + 12;
    }
    return { sx, sy, pw, ph, bottom: M.t + ph };
  }

  /** One bar per x (stacked series), a bar as wide as the gap to the next step, at least a pixel. */
  function drawStackedBars(ctx, w, h, x, series, opts) {
    const windowS = opts.windowS || WINDOW_S;
    let top = opts.yMin || 0;
    for (let i = 0; i < x.length; i++) top = Math.max(top, series.reduce((a, s) => a + (s.values[i] || 0), 0));
    // the budget line only when the steps come near it: a budget far above the steps would flatten them
    const showLine = opts.hline && opts.hline.value <= 2 * top;
    if (showLine) top = Math.max(top, opts.hline.value);
    const f = frame(ctx, w, h, opts.title, niceMax(top * 1.05), windowS, legendOf(series, opts));
    for (let i = 0; i < x.length; i++) {
      const x0 = f.sx(x[i]), x1 = i + 1 < x.length ? f.sx(x[i + 1]) : x0 + 1;
      const bw = Math.max(1, Math.min(8, x1 - x0));
      let base = 0;
      for (const s of series) {
        const v = s.values[i] || 0;
        if (v <= 0) continue;
        ctx.fillStyle = s.color;
        ctx.fillRect(x0, f.sy(base + v), bw, f.sy(base) - f.sy(base + v));
        base += v;
      }
    }
    if (showLine) hline(ctx, f, w, opts.hline);
    return x.length;
  }

  /** Stacked areas (series are cumulative), for counts that change in steps. */
  function drawStackedArea(ctx, w, h, x, series, opts) {
    const windowS = opts.windowS || WINDOW_S;
    let top = opts.yMin || 1;
    for (let i = 0; i < x.length; i++) top = Math.max(top, series.reduce((a, s) => a + (s.values[i] || 0), 0));
    const f = frame(ctx, w, h, opts.title, opts.yMax || niceMax(top * 1.05), windowS, legendOf(series, opts));
    const base = new Array(x.length).fill(0);
    for (const s of series) {
      if (!x.length) break;
      ctx.fillStyle = s.color;
      ctx.beginPath();
      ctx.moveTo(f.sx(x[0]), f.sy(base[0]));
      for (let i = 0; i < x.length; i++) ctx.lineTo(f.sx(x[i]), f.sy(base[i] + (s.values[i] || 0)));
      for (let i = x.length - 1; i >= 0; i--) ctx.lineTo(f.sx(x[i]), f.sy(base[i]));
      ctx.closePath(); ctx.fill();
      for (let i = 0; i < x.length; i++) base[i] += s.values[i] || 0;
    }
    for (const l of opts.lines || []) polyline(ctx, f, x, l);
    return x.length;
  }

  /** Dots per step for each series (null skipped), horizontal limit line, vertical markers. */
  function drawDots(ctx, w, h, x, series, opts) {
    const windowS = opts.windowS || WINDOW_S;
    let top = 0;
    for (const s of series) for (const v of s.values) if (v !== null && v > top) top = v;
    if (opts.hline && opts.hline.value > 0) top = Math.max(top, opts.hline.value);
    const legend = legendOf(series, opts).concat((opts.markers || []).map((m) => ({ label: m.label, color: m.color })));
    // a wild step must not flatten the rest: cap the axis at 3x the limit (or the 99th percentile), mark the clipped
    const all = series.flatMap((s) => s.values.filter((v) => v !== null)).sort((a, b) => a - b);
    const p99 = all.length ? all[Math.floor(0.99 * (all.length - 1))] : 0;
    const cap = Math.max(opts.hline && opts.hline.value > 0 ? 3 * opts.hline.value : 0, 1.2 * p99);
    const yMax = niceMax(Math.min(top, cap || top) * 1.05);
    const f = frame(ctx, w, h, opts.title, yMax, windowS, legend);
    for (const m of opts.markers || []) {
      ctx.strokeStyle = m.color; ctx.lineWidth = 1;
      for (const mx of m.x) {
        const px = f.sx(mx);
        ctx.beginPath(); ctx.moveTo(px, M.t); ctx.lineTo(px, f.bottom); ctx.stroke();
        ctx.fillStyle = m.color;
        ctx.beginPath(); ctx.moveTo(px - 4, M.t); ctx.lineTo(px + 4, M.t); ctx.lineTo(px, M.t + 6); ctx.closePath(); ctx.fill();
      }
    }
    for (const s of series) {
      ctx.fillStyle = s.color;
      for (let i = 0; i < x.length; i++) {
        const v = s.values[i];
        if (v === null || v === undefined) continue;
        const clipped = v > yMax;
        ctx.fillRect(f.sx(x[i]) - 1, f.sy(clipped ? yMax : v) - 1, clipped ? 3 : 2, clipped ? 4 : 2);
      }
    }
    if (opts.hline && opts.hline.value > 0) hline(ctx, f, w, opts.hline);
    return x.length;
  }

  /** Bars per bucket; edges are upper bounds in seconds, the last bucket is "above the last edge". */
  function drawHistogram(ctx, w, h, hist, opts) {
    ctx.clearRect(0, 0, w, h);
    const counts = hist ? hist.counts : [], edges = hist ? hist.edges : [];
    const total = counts.reduce((a, b) => a + b, 0);
    const top = niceMax(Math.max(1, ...counts) * 1.05);
    const pw = w - M.l - M.r, ph = h - M.t - M.b - 6, n = Math.max(1, counts.length);
    ctx.font = "bold 12px sans-serif"; ctx.textBaseline = "middle"; ctx.textAlign = "left"; ctx.fillStyle = C.text;
    ctx.fillText(`${opts.title} (${total} samples)`, 4, 9);
    ctx.font = "10px sans-serif"; ctx.textAlign = "right"; ctx.fillStyle = C.axis;
    ctx.strokeStyle = C.grid;
    const ticks = divisions(top);
    for (let k = 0; k <= ticks; k++) {
      const y = M.t + ph - ph * k / ticks;
      ctx.beginPath(); ctx.moveTo(M.l, y); ctx.lineTo(w - M.r, y); ctx.stroke();
      ctx.fillText(fmt(top * k / ticks), M.l - 4, y);
    }
    ctx.textAlign = "center";
    const bw = pw / n;
    const every = Math.max(1, Math.ceil(44 / bw));  // a label is ~40 px wide: skip some when the bars are narrow
    counts.forEach((c, i) => {
      ctx.fillStyle = opts.color;
      const bh = c / top * ph;
      ctx.fillRect(M.l + i * bw + 1, M.t + ph - bh, Math.max(1, bw - 2), bh);
      ctx.fillStyle = C.axis;
      const label = i < edges.length ? "≤" + ms(edges[i]) : ">" + ms(edges[edges.length - 1]);
      if (i % every === 0) ctx.fillText(label, M.l + (i + 0.5) * bw, h - M.b / 2 - 2);
    });
    return total;
  }

  function ms(s) { return s >= 1 ? s + "s" : Math.round(s * 1000) + "ms"; }

  function hline(ctx, f, w, { value, color, label }) {
    const y = f.sy(value);
    ctx.strokeStyle = color; ctx.setLineDash([5, 4]); ctx.lineWidth = 1.5;
    ctx.beginPath(); ctx.moveTo(M.l, y); ctx.lineTo(w - M.r, y); ctx.stroke();
    ctx.setLineDash([]); ctx.lineWidth = 1;
    if (label) { ctx.fillStyle = color; ctx.textAlign = "left"; ctx.fillText(label, M.l + 4, y - 7); }
  }

  function polyline(ctx, f, x, { values, color, dash }) {
    if (!x.length) return;
    ctx.strokeStyle = color; ctx.lineWidth = 1.5;
    if (dash) ctx.setLineDash([4, 3]);
    ctx.beginPath();
    x.forEach((xi, i) => (i ? ctx.lineTo(f.sx(xi), f.sy(values[i])) : ctx.moveTo(f.sx(xi), f.sy(values[i]))));
    ctx.stroke(); ctx.setLineDash([]); ctx.lineWidth = 1;
  }

  function legendOf(series, opts) {
    const items = series.map((s) => ({ label: s.label, color: s.color }));
    for (const l of opts.lines || []) items.push({ label: l.label, color: l.color, dash: true });
    if (opts.hline && opts.hline.value > 0 && opts.hline.legend) items.push({ label: opts.hline.legend, color: opts.hline.color, dash: true });
    return items;
  }

  /** Every chart of one model on the given contexts ({composition, duration, queues, kv, ttft, tbt}, each
   * {ctx, w, h}); a context left out is skipped. Returns the number of steps drawn. */
  function drawModel(contexts, m, windowS) {
    windowS = windowS || WINDOW_S;
    const info = m.info || {};
    const col = columns(m.steps, m.now, windowS);
    const on = (name, fn) => { const c = contexts[name]; return c ? fn(c.ctx, c.w, c.h) : 0; };
    const drawn = on("composition", (ctx, w, h) => drawStackedBars(ctx, w, h, col.x, [
      { label: "decode tokens", color: C.decode, values: col.decode },
      { label: "prompt tokens", color: C.prefill, values: col.prefill }],
      { title: "Step composition (tokens per step)", windowS,
        hline: info.max_num_batched_tokens ? { value: info.max_num_batched_tokens, color: C.axis, label: "token budget " + info.max_num_batched_tokens } : null }));
    on("duration", (ctx, w, h) => drawDots(ctx, w, h, col.x, [
      { label: "step ms", color: C.dur, values: col.dur },
      ...(col.pred.some((v) => v !== null) ? [{ label: "predicted ms", color: C.pred, values: col.pred }] : [])],
      { title: "Step duration (ms)", windowS,
        hline: { value: info.max_step_ms || 0, color: C.limit, legend: "max-step-ms", label: info.max_step_ms ? info.max_step_ms + " ms" : "" },
        markers: [{ label: "preemption", color: C.preempt, x: col.preempt }, { label: "stall", color: C.stall, x: col.stall }] }));
    on("queues", (ctx, w, h) => {
      const pc = priorityColumns(m.history, m.now, windowS);
      if (pc.x.length) return drawStackedArea(ctx, w, h, pc.x, pc.series, { title: "Requests by state and priority", windowS });
      return drawStackedArea(ctx, w, h, col.x, STATES.map((st) => ({ label: st, color: C[st], values: col[st] })),
        { title: "Requests by state", windowS });
    });
    on("kv", (ctx, w, h) => {
      const n = col.x.length, used = n ? col.used[n - 1] : 0, total = n ? used + col.free[n - 1] : info.num_blocks || 0;
      const pct = total ? (100 * used / total).toFixed(1) : "0";
      return drawStackedArea(ctx, w, h, col.x, [
        { label: "used", color: C.used, values: col.used },
        { label: "free", color: C.free, values: col.free }],
        { title: `KV blocks: ${used} of ${total} used (${pct} %)`, windowS, yMax: total || undefined,
          lines: [{ label: "prefix-cached (used or free)", color: C.cached, values: col.cached, dash: true }] });
    });
    const lat = m.latency || {};
    const span = lat.window_s === null ? "whole run" : "last minute";  // a static report covers its whole run
    on("ttft", (ctx, w, h) => drawHistogram(ctx, w, h, lat.ttft, { title: "TTFT, " + span, color: C.ttft }));
    on("tbt", (ctx, w, h) => drawHistogram(ctx, w, h, lat.tbt, { title: "TBT, " + span, color: C.tbt }));
    return drawn;
  }

  // ---------------------------------------------------------------- DOM: one row per model

  const PANELS = ["composition", "duration", "queues", "kv", "ttft", "tbt"];

  function esc(s) {
    return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }

  function rowFor(container, name) {
    const id = "model-" + name.replace(/[^A-Za-z0-9_-]/g, "_");
    let row = container.querySelector("#" + id);
    if (row) return row;
    row = document.createElement("section");
    row.className = "model"; row.id = id; row.dataset.model = name;
    row.innerHTML = `<h2><span class="name"></span> <small class="info"></small> <small class="drawn"></small></h2>
      <div class="grid">${PANELS.map((p) => `<canvas class="chart ${p}" data-panel="${p}"></canvas>`).join("")}</div>
      <table class="requests"><thead><tr><th>request</th><th>priority</th><th>state</th><th>prompt</th><th>tokens out</th><th>age</th><th>preempted</th></tr></thead><tbody></tbody></table>`;
    row.querySelector(".name").textContent = name;
    container.appendChild(row);
    return row;
  }

  function contextsOf(row) {
    const out = {}, dpr = (typeof window !== "undefined" && window.devicePixelRatio) || 1;
    for (const canvas of row.querySelectorAll("canvas.chart")) {
      const w = canvas.clientWidth || 400, h = canvas.clientHeight || 200;
      if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
        canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
      }
      const ctx = canvas.getContext("2d");
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      out[canvas.dataset.panel] = { ctx, w, h };
    }
    return out;
  }

  function renderTable(row, m) {
    const body = row.querySelector("table.requests tbody");
    const st = m.state;
    if (!st) { body.innerHTML = `<tr><td colspan="7" class="muted">no snapshot (static report)</td></tr>`; return; }
    const rows = st.requests.map((r) => {
      const pct = r.prompt ? Math.round(100 * r.prompt_done / r.prompt) : 0;
      return `<tr class="${esc(r.state)}"><td title="${esc(r.id)}">${esc(r.id.length > 28 ? r.id.slice(0, 12) + "…" + r.id.slice(-12) : r.id)}</td>` +
        `<td>${esc(r.priority)}</td><td>${esc(r.state)}</td>` +
        `<td><span class="bar"><span style="width:${pct}%"></span></span> ${r.prompt_done}/${r.prompt}</td>` +
        `<td>${r.out}${r.max_out ? " / " + r.max_out : ""}</td><td>${r.age.toFixed(1)} s</td><td>${r.preemptions}</td></tr>`;
    });
    if (st.num_requests > st.requests.length) rows.push(`<tr><td colspan="7" class="muted">… and ${st.num_requests - st.requests.length} more</td></tr>`);
    body.innerHTML = rows.join("") || `<tr><td colspan="7" class="muted">no requests in flight</td></tr>`;
  }

  /** Draw every model of the store into container (rows made on first use); returns the steps drawn. */
  function render(container, store) {
    let total = 0;
    for (const m of store.models.values()) {
      const row = rowFor(container, m.name);
      const info = m.info || {};
      row.querySelector(".info").textContent = [info.policy && "scheduler " + info.policy,
        info.max_step_ms ? "max-step-ms " + info.max_step_ms : "", info.max_num_batched_tokens && "budget " + info.max_num_batched_tokens + " tokens",
        info.num_blocks && info.num_blocks + " KV blocks × " + info.block_size].filter(Boolean).join(" · ");
      const drawn = drawModel(contextsOf(row), m, store.windowS);
      row.dataset.stepsDrawn = drawn;
      row.querySelector(".drawn").textContent = drawn + " steps drawn";
      renderTable(row, m);
      total += drawn;
    }
    store.stepsDrawn = total;
    return total;
  }

  /** A static page: draw a list of step records (any models), e.g. a benchmark's or simulator's run. */
  function drawSteps(container, steps, opts) {
    opts = opts || {};
    const store = createStore(opts.windowS || Infinity);
    const byModel = new Map();
    for (const s of steps) { const k = s.model || "model"; if (!byModel.has(k)) byModel.set(k, []); byModel.get(k).push(s); }
    // a system with latency figures but no step log (a peer server): its histograms still get a row
    for (const k of Object.keys(opts.latency || {})) if (!byModel.has(k)) byModel.set(k, []);
    for (const [model, list] of byModel) {
      const now = opts.now !== undefined ? opts.now : list.length ? list[list.length - 1].t : 0;
      ingest(store, { model, now, info: (opts.info || {})[model] || null, steps: list,
                      latency: (opts.latency || {})[model] || null });
    }
    if (!isFinite(store.windowS)) {  // the whole run on one axis
      let span = 1;
      for (const m of store.models.values()) if (m.steps.length) span = Math.max(span, m.now - m.steps[0].t);
      store.windowS = span;
    }
    return render(container, store);
  }

  /** The live page: an EventSource on url; redraws at most once a frame. */
  function connect(url, container, ui) {
    ui = ui || {};
    const store = createStore();
    let pending = false;
    const draw = () => {
      pending = false;
      const n = render(container, store);
      if (ui.drawn) ui.drawn.textContent = n + " steps drawn";
    };
    const source = new EventSource(url);
    source.onopen = () => { if (ui.status) { ui.status.textContent = "live"; ui.status.className = "live"; } };
    source.onerror = () => { if (ui.status) { ui.status.textContent = "reconnecting…"; ui.status.className = "down"; } };
    source.onmessage = (e) => {
      ingest(store, JSON.parse(e.data));
      if (!pending) { pending = true; requestAnimationFrame(draw); }
    };
    window.addEventListener("resize", () => requestAnimationFrame(draw));
    return { store, source };
  }

  return { WINDOW_S, createStore, ingest, columns, priorityColumns, drawModel, drawStackedBars, drawStackedArea,
           drawDots, drawHistogram, render, drawSteps, connect };
});
