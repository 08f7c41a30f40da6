// stoa dashboard: polls api/state and draws it. Every string from the store goes in as text
// (textContent, createTextNode), never as markup: a worker's id or ban reason is shown, not run.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
let last = null;
let timer = null;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}

function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
  return node;
}

function num(x, digits) {
  if (typeof x !== "number" || !isFinite(x)) return "-";
  if (digits !== undefined) return x.toFixed(digits);
  return Math.abs(x) >= 1000 ? Math.round(x).toLocaleString("en") : String(Math.round(x * 1000) / 1000);
}

function ago(seconds) {
  if (typeof seconds !== "number" || !isFinite(seconds)) return "-";
  if (seconds < 90) return Math.round(seconds) + " s ago";
  if (seconds < 5400) return Math.round(seconds / 60) + " min ago";
  return (seconds / 3600).toFixed(1) + " h ago";
}

function when(t) {
  return typeof t === "number" ? new Date(t * 1000).toLocaleString() : "-";
}

function facts(node, pairs) {
  clear(node);
  for (const [name, value] of pairs) {
    const d = el("div");
    d.appendChild(el("dt", null, name));
    d.appendChild(el("dd", null, value));
    node.appendChild(d);
  }
}

// The worker a link points at: #worker=<id> or ?worker=<id>.
function wanted() {
  const h = new URLSearchParams(location.hash.slice(1)).get("worker");
  return h !== null ? h : new URLSearchParams(location.search).get("worker");
}

function tickValues(lo, hi, log) {
  if (log) {
    const out = [];
    for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) out.push(Math.pow(10, e));
    return out;
  }
  return [lo, (lo + hi) / 2, hi];
}

function chart(c) {
  const box = el("div", "chart");
  box.id = "chart-" + c.id;
  box.appendChild(el("h3", null, c.title));
  const series = c.series.filter(s => s.points.length > 0);
  const total = series.reduce((n, s) => n + s.points.length, 0);
  box.dataset.points = String(total);
  if (!series.length) {
    box.appendChild(el("p", "note", c.note || "no data yet"));
    return box;
  }
  const W = 360, H = 190, L = 50, R = 10, T = 8, B = 30;
  const xs = series.flatMap(s => s.points.map(p => p[0]));
  const ys = series.flatMap(s => s.points.map(p => p[1])).filter(y => !c.log || y > 0);
  let x0 = Math.min(...xs), x1 = Math.max(...xs);
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (!c.log) { y0 = Math.min(0, y0); }
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y1 = y0 + (c.log ? y0 : 1); }
  if (c.log) { y0 = Math.pow(10, Math.floor(Math.log10(y0))); y1 = Math.pow(10, Math.ceil(Math.log10(y1))); }
  const fy = c.log ? (y => Math.log10(y)) : (y => y);
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const Y = y => H - B - (fy(y) - fy(y0)) / (fy(y1) - fy(y0)) * (H - T - B);
  const s = svg("svg", {viewBox: `0 0 ${W} ${H}`, role: "img"});
  for (const v of tickValues(y0, y1, c.log)) {
    s.appendChild(svg("line", {x1: L, x2: W - R, y1: Y(v), y2: Y(v), class: "grid"}));
    const t = svg("text", {x: L - 4, y: Y(v) + 3, "text-anchor": "end", class: "tick"});
    t.textContent = c.log ? v.toExponential(0) : num(v);
    s.appendChild(t);
  }
  for (const v of [x0, x1]) {
    const t = svg("text", {x: X(v), y: H - B + 14, "text-anchor": v === x0 ? "start" : "end", class: "tick"});
    t.textContent = num(v);
    s.appendChild(t);
  }
  const xl = svg("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", class: "tick"});
  xl.textContent = c.x;
  s.appendChild(xl);
  s.appendChild(svg("line", {x1: L, x2: L, y1: T, y2: H - B, class: "axis"}));
  s.appendChild(svg("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis"}));
  const legend = el("div", "legend");
  series.forEach((ser, i) => {
    const cls = "s" + (i % 5);
    const pts = ser.points.filter(p => !c.log || p[1] > 0);
    s.appendChild(svg("polyline", {points: pts.map(p => `${X(p[0])},${Y(p[1])}`).join(" "), class: "line " + cls}));
    const g = svg("g", {class: "points " + cls, "data-series": i});
    for (const p of pts) {
      const dot = svg("circle", {cx: X(p[0]), cy: Y(p[1]), r: pts.length > 60 ? 1.2 : 2.6, class: cls});
      const tip = svg("title");
      tip.textContent = `${ser.name}: ${num(p[1])} at ${num(p[0])}`;
      dot.appendChild(tip);
      g.appendChild(dot);
    }
    s.appendChild(g);
    const item = el("span");
    item.appendChild(el("span", "swatch " + cls));
    item.appendChild(document.createTextNode(`${ser.name} (${pts.length})`));
    legend.appendChild(item);
  });
  box.appendChild(s);
  box.appendChild(legend);
  if (c.y) box.appendChild(el("p", "note", c.y));
  return box;
}

function chips(tags) {
  const td = el("td");
  for (const t of tags) td.appendChild(el("span", "chip " + t.replace(/[^a-z?]/g, ""), t));
  return td;
}

function rejected(r) {
  if (!r || typeof r !== "object") return "-";
  const parts = Object.entries(r).map(([c, n]) => `${c} ${n}`);
  return parts.length ? parts.join(", ") : "0";
}

function workerRow(w, mine) {
  const tr = el("tr");
  tr.dataset.worker = String(w.worker_id);
  if (mine !== null && w.worker_id === mine) tr.classList.add("mine");
  const id = el("td", "id");
  const a = el("a", null, w.worker_id);
  a.href = "#worker=" + encodeURIComponent(String(w.worker_id));
  id.appendChild(a);
  tr.appendChild(id);
  tr.appendChild(chips(w.standing));
  const withheld = w.withheld ? `${w.withheld} (${num(100 * (w.withheld_rate || 0), 0)}%)` : num(w.withheld);
  for (const v of [w.status || "-", num(w.version), num(w.lag), ago(w.age_s), num(w.tokens_per_s, 0),
                   num(w.accepted_batches), rejected(w.rejected), num(w.strikes), withheld,
                   w.key ? String(w.key).slice(0, 8) : "-"]) {
    tr.appendChild(el("td", null, v));
  }
  return tr;
}

function applyFilter() {
  const q = document.getElementById("filter").value.trim();
  for (const tr of document.querySelectorAll("#workers tbody tr")) {
    tr.classList.toggle("hidden", q !== "" && !tr.dataset.worker.includes(q));
  }
}

function render(d) {
  last = d;
  const mine = wanted();
  document.getElementById("run").textContent = d.run;
  const state = document.getElementById("state");
  state.textContent = d.state;
  state.className = "chip " + String(d.state).replace(/[^a-z]/g, "");
  document.getElementById("updated").textContent =
    `read ${when(d.time)}; refreshes every ${d.refresh_s} s; curves from ${d.source}`;
  const err = document.getElementById("error");
  err.hidden = !d.error;
  err.textContent = d.error ? `the last read failed (showing the one before): ${d.error}` : "";
  const unv = document.getElementById("unverified");
  unv.hidden = d.verified;
  unv.textContent = d.verified ? "" : `${(d.unverified || []).join(", ") || "nothing signed yet"}: ${d.unverified_why}`;

  facts(document.getElementById("run-facts"), [
    ["head version", num(d.head)], ["steps", num(d.steps)], ["state", d.state],
    ["signatures", d.verified ? "verified" : "UNVERIFIED"],
    ["fleet tokens/s", num(d.fleet.tokens_per_s, 0)],
  ]);
  const lr = d.learning;
  const lp = document.getElementById("learning");
  lp.className = lr && lr.flat_steps ? "bad" : "";
  lp.textContent = !lr ? "" : lr.flat_steps
    ? `no learning signal for ${lr.flat_steps} steps in a row: every group's episodes got the same reward (mean ${num(lr.reward, 3)})`
    : `learning signal: ${num(100 * lr.signal_frac, 0)}% of the head version's groups had rewards that differ (mean reward ${num(lr.reward, 3)})`;
  const charts = clear(document.getElementById("charts"));
  for (const c of d.charts) charts.appendChild(chart(c));

  facts(document.getElementById("fleet-facts"), [
    ["workers", num(d.fleet.workers)], ["alive", num(d.fleet.alive)], ["banned", num(d.fleet.banned)],
    ["trust mode", d.trust ? d.trust.mode : "-"], ["trust report as of version", d.trust ? num(d.trust.version) : "-"],
  ]);
  const body = clear(document.querySelector("#workers tbody"));
  for (const w of d.workers) body.appendChild(workerRow(w, mine));
  applyFilter();

  const bans = clear(document.getElementById("bans"));
  for (const w of d.workers) {
    const lines = [];
    if (w.banned) lines.push(["banned", w.banned]);
    else if (w.strikes) lines.push([`${w.strikes} strike${w.strikes > 1 ? "s" : ""}`, w.last_reason || rejected(w.rejected)]);
    if (w.withholding_flagged) lines.push(["withholding?", `${w.withheld} of its numbered batches never came (${num(100 * w.withheld_rate, 0)}%; ${w.late_batches || 0} came late)`]);
    if (w.standing.includes("probation")) lines.push(["probation", `${w.probation_batches} batches of probation work, not trained on yet`]);
    for (const [what, why] of lines) {
      const li = el("li");
      li.appendChild(el("span", "chip " + what.replace(/[^a-z?]/g, ""), what));
      li.appendChild(el("strong", null, ` ${w.worker_id}: `));
      li.appendChild(el("span", "reason", why));
      bans.appendChild(li);
    }
  }
  if (!bans.firstChild) bans.appendChild(el("li", null, "none"));
  const anon = clear(document.getElementById("anonymous"));
  for (const [wid, cats] of Object.entries(d.anonymous || {})) anon.appendChild(el("li", null, `${wid}: ${rejected(cats)}`));
  if (!anon.firstChild) anon.appendChild(el("li", null, "none"));

  const st = d.store;
  const lp2 = st.last_publish;
  facts(document.getElementById("store-facts"), [
    ["last publish", lp2.version === null ? lp2.how : `version ${lp2.version}, ${lp2.time ? when(lp2.time) : lp2.how}`],
    ["rollout batches waiting", num(st.rollouts_waiting)], ["quarantined", num(st.quarantined)],
    ["read errors", num(st.read_errors.length + (d.read_failures || 0))],
  ]);
  const errs = clear(document.getElementById("read-errors"));
  for (const e of st.read_errors) errs.appendChild(el("li", "warn", e));

  const section = document.getElementById("mine");
  const w = mine === null ? null : d.workers.find(x => x.worker_id === mine);
  section.hidden = mine === null;
  if (mine !== null) {
    document.getElementById("mine-id").textContent = mine;
    facts(document.getElementById("mine-facts"), w ? [
      ["standing", w.standing.join(", ")], ["status", w.status || "-"], ["last seen", ago(w.age_s)],
      ["lag", num(w.lag)], ["tokens/s", num(w.tokens_per_s, 0)], ["accepted batches", num(w.accepted_batches)],
      ["rejected", rejected(w.rejected)], ["trained episodes", num(w.trained_episodes)],
      ["ban", w.banned || "-"],
    ] : [["not found", "no heartbeat or trust record with this id yet"]]);
  }
}

async function poll() {
  let wait = 5;
  try {
    const r = await fetch("api/state", {cache: "no-store", headers: {accept: "application/json"}});
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const d = await r.json();
    render(d);
    wait = d.refresh_s;
  } catch (e) {
    const err = document.getElementById("error");
    err.hidden = false;
    err.textContent = `cannot reach the dashboard server: ${e}`;
  }
  timer = setTimeout(poll, Math.max(1, wait) * 1000);
}

document.getElementById("filter").addEventListener("input", applyFilter);
window.addEventListener("hashchange", () => { if (last) render(last); });
poll();
