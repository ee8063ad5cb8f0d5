// tinsmith dashboard: polls the server's JSON and draws it. No framework, no build step.
// Everything from the server is inserted as text (textContent), never as HTML: run names and
// metadata are user input.
"use strict";

const KEY_STORE = "tinsmith-api-key";
const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";

const $ = (id) => document.getElementById(id);
let timer = null;
let lastSummary = null;

// ------------------------------------------------------------------------------ formatting
function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n : n.toFixed(1)) + " " + units[i];
}

function fmtAge(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.max(0, seconds);
  if (s < 60) return s.toFixed(s < 10 ? 1 : 0) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min";
  if (s < 86400) return (s / 3600).toFixed(1) + " h";
  return (s / 86400).toFixed(1) + " d";
}

function fmtWhen(iso) {
  if (!iso) return "–";
  return fmtAge((Date.now() - Date.parse(iso)) / 1000) + " ago";
}

function fmtUntil(iso) {
  if (!iso) return "never";
  const s = (Date.parse(iso) - Date.now()) / 1000;
  return s <= 0 ? "expired" : "in " + fmtAge(s);
}

function fmtNum(v) {
  if (v === null || v === undefined) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(3);
  return Number(v.toPrecision(5)).toString();
}

function shortOwner(owner) {
  return owner.length > 14 ? owner.slice(0, 14) + "…" : owner;
}

// ------------------------------------------------------------------------------ DOM helpers
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const c of cells) tr.appendChild(c instanceof Node ? c : el("td", c));
  return tr;
}

function ownerCell(owner) {
  const td = el("td", shortOwner(owner), "owner-col");
  td.title = owner;
  return td;
}

function fillTable(id, rows, emptyText) {
  const body = $(id).querySelector("tbody");
  body.replaceChildren(...rows);
  if (!rows.length) {
    const td = el("td", emptyText, "empty");
    td.colSpan = $(id).querySelectorAll("thead th").length;
    body.appendChild(row([td]));
  }
}

function fillList(id, pairs) {
  const dl = $(id);
  dl.replaceChildren();
  for (const [k, v] of pairs) { dl.appendChild(el("dt", k)); dl.appendChild(el("dd", v)); }
}

// ------------------------------------------------------------------------------ server calls
function apiKey() { return sessionStorage.getItem(KEY_STORE); }

async function call(path, options = {}) {
  const response = await fetch(path, {
    ...options,
    headers: { "X-API-Key": apiKey() || "", ...(options.headers || {}) },
    cache: "no-store",
  });
  let body = null;
  try { body = await response.json(); } catch (e) { body = null; }
  if (!response.ok) {
    const err = new Error((body && body.detail) || response.status + " " + response.statusText);
    err.status = response.status;
    throw err;
  }
  return body;
}

// ------------------------------------------------------------------------------ login
function showLogin(message) {
  clearTimeout(timer);
  $("app").hidden = true;
  $("logout").hidden = true;
  $("who").textContent = "";
  $("live").textContent = "";
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("api-key").focus();
}

async function login(event) {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORE, key);
  $("api-key").value = "";
  try {
    await refresh();
  } catch (e) {
    sessionStorage.removeItem(KEY_STORE);
    showLogin(e.status === 401 ? "This key is not accepted by the server." : e.message);
  }
}

function logout() {
  sessionStorage.removeItem(KEY_STORE);
  location.hash = "";
  showLogin("");
}

// ------------------------------------------------------------------------------ overview
function renderSummary(s) {
  const me = s.caller;
  $("who").replaceChildren(el("span", "key " + shortOwner(me.owner)));
  $("who").title = me.owner;
  if (me.admin) $("who").appendChild(el("span", "admin: all keys", "badge"));
  if (me.single_user) $("who").appendChild(el("span", " (single-user mode)", "muted"));
  document.body.classList.toggle("hide-owner", !me.admin);

  const h = s.health, t = s.throughput;
  const pairs = [
    ["Version", s.server.version],
    ["Base models", s.server.base_models.join(", ")],
    ["Up", fmtAge(s.server.uptime_s)],
    ["Process memory", fmtBytes(h.process_rss_bytes)],
    ["Host memory available", fmtBytes(h.host_available_bytes) + " of " + fmtBytes(h.host_total_bytes)],
    ["CPU", h.cpu_percent.toFixed(0) + " %"],
  ];
  for (const d of h.devices) {
    const used = d.used_bytes === null ? "–" : fmtBytes(d.used_bytes) + " of " + fmtBytes(d.total_bytes);
    const util = d.utilization_percent === null ? "" : ", " + d.utilization_percent.toFixed(0) + " % busy";
    pairs.push(["GPU " + d.index + " (" + d.name + ")", used + " used, " + fmtBytes(d.allocated_bytes) +
      " allocated here" + util]);
  }
  if (!h.devices.length) pairs.push(["GPU", "none"]);
  pairs.push(["Trained, last " + t.window_s + " s", t.tokens_trained + " tokens (" + t.train_tokens_per_s.toFixed(1) + " /s)"]);
  pairs.push(["Sampled, last " + t.window_s + " s", t.tokens_sampled + " tokens (" + t.sample_tokens_per_s.toFixed(1) + " /s)"]);
  pairs.push(["Requests queued or running", String(s.queue.length)]);
  fillList("health", pairs);

  const selected = selectedRun();
  fillTable("runs", s.runs.map((r) => {
    const link = el("a", r.model_id);
    link.href = "#run=" + encodeURIComponent(r.model_id);
    const tr = row([wrap("td", link), ownerCell(r.owner), r.base_model, r.is_lora ? r.lora_rank : "full",
      r.steps, r.status, fmtWhen(r.last_activity)]);
    tr.dataset.runId = r.model_id;
    if (r.model_id === selected) tr.classList.add("selected");
    return tr;
  }), "No training runs yet.");

  fillTable("queue", s.queue.map((q) => row([q.request_id, q.kind, q.model_id || "–", ownerCell(q.owner), q.state,
    fmtAge(q.age_s)])), "Nothing queued.");
  fillTable("samplers", s.samplers.map((x) => row([x.key, ownerCell(x.owner), x.base_model, x.lora_rank,
    x.stored ? "yes" : "no (memory only)", fmtAge(x.idle_s)])), "No sampler snapshots in memory.");
}

function wrap(tag, child) {
  const e = document.createElement(tag);
  e.appendChild(child);
  return e;
}

// ------------------------------------------------------------------------------ one run
function selectedRun() {
  const m = /^#run=(.+)$/.exec(location.hash);
  return m ? decodeURIComponent(m[1]) : null;
}

function renderRun(d) {
  const r = d.run;
  $("run-title").textContent = r.model_id;
  const info = [["Base model", r.base_model], ["LoRA rank", r.is_lora ? r.lora_rank : "full fine-tune"],
    ["Steps", r.steps], ["Status", r.status], ["Created", fmtWhen(r.created_at)],
    ["Last activity", fmtWhen(r.last_activity)], ["Metric points kept", d.points]];
  if (lastSummary && lastSummary.caller.admin) info.splice(0, 0, ["Owner", r.owner]);
  for (const [k, v] of Object.entries(r.user_metadata)) info.push(["metadata: " + k, v]);
  fillList("run-info", info);

  const names = Object.keys(d.metrics).sort((x, y) =>
    (y.startsWith("loss") - x.startsWith("loss")) || x.localeCompare(y));  // the loss first
  $("charts-empty").hidden = names.length > 0;
  $("charts").replaceChildren(...names.map((n) => chart(n, d.metrics[n])));

  fillTable("checkpoints", d.checkpoints.map((c) => {
    const actions = document.createElement("td");
    if (c.downloadable) actions.appendChild(button("Download", () => showDownloads(r.model_id, c)));
    if (c.deletable) actions.appendChild(button("Delete", () => deleteCheckpoint(r.model_id, c)));
    const tr = row([c.checkpoint_type, c.name, fmtBytes(c.size_bytes), fmtWhen(c.time), fmtUntil(c.expires_at), actions]);
    tr.dataset.checkpoint = c.tinker_path;
    return tr;
  }), "No checkpoints saved.");
}

function button(label, onClick) {
  const b = el("button", label);
  b.type = "button";
  b.addEventListener("click", onClick);
  return b;
}

async function showDownloads(runId, c) {
  const box = $("downloads");
  try {
    const path = "/dashboard/api/runs/" + encodeURIComponent(runId) + "/checkpoints/" +
      encodeURIComponent(c.kind) + "/" + encodeURIComponent(c.name) + "/files";
    const d = await call(path);
    const list = el("ul");
    for (const [file, url] of Object.entries(d.urls)) {
      const a = el("a", file);
      a.href = url;
      a.setAttribute("download", file);
      list.appendChild(wrap("li", a));
    }
    box.replaceChildren(el("p", "Files of " + c.tinker_path + " (links valid until " +
      new Date(d.expires).toLocaleString() + "):"), list);
  } catch (e) {
    box.replaceChildren(el("p", e.message, "error"));
  }
}

async function deleteCheckpoint(runId, c) {
  if (!confirm("Delete " + c.tinker_path + "? This cannot be undone.")) return;
  try {
    await call("/api/v1/training_runs/" + encodeURIComponent(runId) + "/checkpoints/" +
      encodeURIComponent(c.kind) + "/" + encodeURIComponent(c.name), { method: "DELETE" });
    $("downloads").replaceChildren();
    await refresh();
  } catch (e) {
    $("error").textContent = e.message;
  }
}

// ------------------------------------------------------------------------------ charts (inline SVG)
function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

function chart(name, points) {
  const W = 420, H = 200, L = 64, R = 12, T = 24, B = 30;
  const box = svg("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H, class: "chart", "data-metric": name,
    role: "img", "aria-label": name + " over steps" });
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
  const px = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  box.appendChild(svg("text", { x: L, y: 15 }, name + "  (last " + fmtNum(ys[ys.length - 1]) + ")"));
  box.appendChild(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#9aa4af" }));
  box.appendChild(svg("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#9aa4af" }));
  box.appendChild(svg("text", { x: L - 4, y: T + 4, "text-anchor": "end" }, fmtNum(y1)));
  box.appendChild(svg("text", { x: L - 4, y: H - B, "text-anchor": "end" }, fmtNum(y0)));
  box.appendChild(svg("text", { x: L, y: H - B + 14, "text-anchor": "middle" }, String(x0 < 0 ? 0 : x0)));
  box.appendChild(svg("text", { x: W - R, y: H - B + 14, "text-anchor": "end" }, String(x1)));
  box.appendChild(svg("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" }, "step"));
  const coords = points.map((p) => px(p[0]).toFixed(1) + "," + py(p[1]).toFixed(1)).join(" ");
  box.appendChild(svg("polyline", { points: coords, fill: "none", stroke: "#1f6feb", "stroke-width": 1.6 }));
  if (points.length <= 60) {
    for (const p of points) box.appendChild(svg("circle", { cx: px(p[0]), cy: py(p[1]), r: 2.2, fill: "#1f6feb" }));
  }
  return box;
}

// ------------------------------------------------------------------------------ polling
async function refresh() {
  clearTimeout(timer);
  const s = await call("/dashboard/api/summary");
  lastSummary = s;
  $("login").hidden = true;
  $("app").hidden = false;
  $("logout").hidden = false;
  $("error").textContent = "";
  renderSummary(s);
  const run = selectedRun();
  $("run-detail").hidden = !run;
  if (run) {
    try {
      renderRun(await call("/dashboard/api/runs/" + encodeURIComponent(run)));
    } catch (e) {
      $("error").textContent = e.message;
      $("run-detail").hidden = true;
    }
  }
  $("live").textContent = "updated " + new Date().toLocaleTimeString();
  timer = setTimeout(poll, POLL_MS);
}

async function poll() {
  try {
    await refresh();
  } catch (e) {
    if (e.status === 401) { sessionStorage.removeItem(KEY_STORE); showLogin("Your key is no longer accepted."); return; }
    $("error").textContent = "Cannot reach the server: " + e.message;
    timer = setTimeout(poll, POLL_MS * 2);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", login);
  $("logout").addEventListener("click", logout);
  $("run-close").addEventListener("click", (e) => { e.preventDefault(); location.hash = ""; });
  window.addEventListener("hashchange", () => { $("downloads").replaceChildren(); if (apiKey()) poll(); });
  if (apiKey()) poll(); else showLogin("");
});
