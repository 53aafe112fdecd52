// Tidegate's dashboard: reads the admin API with the operator's token and
// redraws every second. No libraries, no external requests; every value
// from the API is written as text, never as markup.
"use strict";

const HISTORY = 60; // samples kept per chart (one a second)
const STATUS_MS = 1000;
const CONFIG_MS = 5000;
const EVENTS_MS = 2000;
const KEEP_EVENTS = 100;
const KEEP_CHANGES = 30;

let token = null;
let config = null; // the last GET /v1/config
let lastEvent = 0; // highest event sequence number seen
const series = new Map(); // "service/backend" -> {rps:[], latency:[], inFlight:[], requests, at}
let timers = [];
let watchAbort = null;

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

async function api(path, opts) {
  const r = await fetch(path, { ...opts, headers: { Authorization: "Bearer " + token } });
  if (r.status === 401) {
    signOut("the token was refused");
    throw new Error("unauthorized");
  }
  if (!r.ok) throw new Error(path + ": " + r.status);
  return r;
}

function fmt(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  return Number(x).toFixed(digits);
}

function clock(ms) {
  return new Date(ms).toLocaleTimeString();
}

// ---- charts ---------------------------------------------------------------

function push(list, v) {
  list.push(v);
  if (list.length > HISTORY) list.shift();
}

function chart(kind, values, title) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "chart " + kind);
  svg.setAttribute("viewBox", `0 0 ${HISTORY - 1} 28`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("data-points", String(values.length));
  const t = document.createElementNS(ns, "title");
  t.textContent = title;
  svg.append(t);
  const max = Math.max(1e-9, ...values);
  const offset = HISTORY - values.length;
  const points = values.map((v, i) => `${offset + i},${(27 - (v / max) * 25).toFixed(2)}`).join(" ");
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", points);
  svg.append(line);
  return svg;
}

// ---- status ---------------------------------------------------------------

function track(service, b, now) {
  const key = service + "/" + b.id;
  let s = series.get(key);
  if (!s) {
    s = { rps: [], latency: [], inFlight: [], requests: b.requests, at: now };
    series.set(key, s);
  }
  const dt = (now - s.at) / 1000;
  if (dt > 0) push(s.rps, Math.max(0, (b.requests - s.requests) / dt));
  push(s.latency, b.latency_ewma_ms || 0);
  push(s.inFlight, b.in_flight);
  s.requests = b.requests;
  s.at = now;
  return s;
}

function scalingLine(sc) {
  if (!sc) return null;
  const c = sc.counts || {};
  const parts = [`desired ${sc.desired}`];
  for (const [k, v] of Object.entries(c)) parts.push(`${k} ${v}`);
  if (sc.panic) parts.push("panic mode");
  if (sc.paused) parts.push("paused");
  if (sc.pinned !== null && sc.pinned !== undefined) parts.push(`pinned at ${sc.pinned}`);
  const d = sc.last_decision;
  const why = d
    ? ` · last decision: ${d.desired} (${((d.reason && d.reason.why) || "").replace(/_/g, " ")}), ` +
      `demand ${fmt(d.demand_long, 1)} instances (short window ${fmt(d.demand_short, 1)}), ` +
      `latency ${fmt(d.latency_ms, 1)} ms`
    : "";
  return el("div", { class: "scaling" }, el("span", { class: "badge" }, "autoscaling"), " ", parts.join(", "), why);
}

// A pool from DNS: the name, the last answer, and the error while
// resolving fails (the last good set keeps serving).
function dnsLine(d) {
  if (!d) return null;
  const when = d.resolved_at_unix_ms ? ` at ${clock(d.resolved_at_unix_ms)}` : "";
  const parts = [`${d.name} (${d.record}): ${d.addresses.length} address(es)${when}, TTL ${d.ttl_s ?? "–"} s`];
  if (d.error) parts.push(`failing: ${d.error}; the last answer serves`);
  return el("div", { class: "scaling" }, el("span", { class: "badge" }, "DNS"), " ", parts.join("; "));
}

function renderServices(status) {
  const now = Date.now();
  const box = $("services");
  const names = Object.keys(status.services);
  const out = [];
  if (names.length === 0) out.push(el("p", { class: "muted" }, "No services yet."));
  for (const name of names) {
    const s = status.services[name];
    const rows = s.backends.map((b) => {
      const h = track(name, b, now);
      const weight = b.effective_weight !== null && b.effective_weight !== undefined
        ? `${b.weight} → ${fmt(b.effective_weight, 2)}` : String(b.weight);
      return el("tr", { "data-backend": b.id },
        el("td", {}, b.id, b.backup ? el("span", { class: "muted" }, " (backup)") : null,
          b.dns ? el("span", { class: "muted" }, " (DNS)") : null),
        el("td", { class: "muted" }, b.addr),
        el("td", {}, el("span", { class: "badge health health-" + b.health }, b.health)),
        el("td", { class: "num" }, weight),
        el("td", { class: "num" }, b.in_flight),
        el("td", { class: "num" }, b.concurrency_limit === null || b.concurrency_limit === undefined ? "–" : b.concurrency_limit),
        el("td", { class: "num" }, fmt(b.latency_ewma_ms, 2)),
        el("td", { class: "num" }, fmt(h.rps[h.rps.length - 1], 0)),
        el("td", { class: "num" }, b.failures),
        el("td", {}, chart("rps", h.rps, "requests/s"), chart("latency", h.latency, "latency (ms)"),
          chart("in-flight", h.inFlight, "in flight")));
    });
    const table = el("table", { class: "backends" },
      el("thead", {}, el("tr", {}, ...["backend", "address", "health", "weight", "in flight", "limit",
        "latency ms", "req/s", "failures", "req/s · latency · in flight (last minute)"].map((t) => el("th", {}, t)))),
      el("tbody", {}, ...rows));
    const policy = s.policy && s.policy.kind ? s.policy.kind : "round_robin";
    out.push(el("div", { class: "service", "data-service": name },
      el("h3", {}, name),
      el("div", { class: "facts" },
        el("span", {}, "policy ", policy), el("span", {}, "in flight ", s.in_flight),
        el("span", {}, "queued ", s.queued, s.queued_clients > 1 ? ` (${s.queued_clients} clients)` : ""),
        el("span", {}, s.learns_limits ? "learned limits" : "fixed limits"),
        el("span", {}, "retries refused ", s.retries_refused)),
      scalingLine(s.scaling), dnsLine(s.dns), table));
  }
  box.replaceChildren(...out);
  $("revision").textContent = "revision " + status.revision;
  // Forget the charts of backends that are gone (autoscaled instances come and go).
  for (const key of series.keys()) {
    const [svc, id] = key.split("/");
    const s = status.services[svc];
    if (!s || !s.backends.some((b) => b.id === id)) series.delete(key);
  }
}

function renderRoutes() {
  if (!config) return;
  const rows = Object.entries(config.routes).map(([name, r]) => {
    const m = r.match || {};
    const path = (m.path ? "= " + m.path : (m.path_prefix || "/") + "*") + (m.methods ? " " + m.methods.join(",") : "");
    // Each rule set the route runs, in order, with its steps' kinds.
    const rules = (r.rules || []).map((set) => {
      const steps = ((config.rules || {})[set] || {}).steps || [];
      return set + " (" + (steps.map((st) => st.kind).join(", ") || "no steps") + ")";
    }).join("; ");
    return el("tr", { "data-route": name }, el("td", {}, name), el("td", {}, m.host || "*"), el("td", {}, path),
      el("td", {}, r.service || (r.static ? "static files in " + r.static.root : "–")),
      el("td", { class: "rules" }, rules || "–"),
      el("td", { class: "listeners" }, (r.listeners || ["default"]).join(", ")),
      el("td", { class: "num" }, r.priority || 0));
  });
  if (rows.length === 0) rows.push(el("tr", {}, el("td", { class: "muted", colspan: "7" }, "No routes yet.")));
  $("routes").tBodies[0].replaceChildren(...rows);
}

// Named listeners (the configuration's), with the state each instance
// reports for its socket: listening, or failed with the error (retried).
function renderListeners(status) {
  if (!config) return;
  const states = (status && status.listeners) || {};
  const rows = Object.entries(config.listeners || {}).map(([name, l]) => {
    const bound = Object.entries(config.routes).filter(([, r]) => (r.listeners || []).includes(name)).map(([n]) => n);
    const st = states[name] || {};
    const state = st.state ? st.state + (st.error ? ": " + st.error : "") : "–";
    return el("tr", { "data-listener": name }, el("td", {}, name), el("td", {}, l.addr), el("td", {}, l.tls ? "yes" : "no"),
      el("td", {}, ((l.proxy_protocol || {}).trusted || []).join(", ") || "–"),
      el("td", {}, bound.join(", ") || "–"),
      el("td", { class: "state" }, el("span", { class: "badge " + (st.state === "listening" ? "health-up" : "health-down") }, state)));
  });
  if (rows.length === 0) {
    rows.push(el("tr", {}, el("td", { class: "muted", colspan: "6" }, "Only the default listeners (--listen, --listen-tls).")));
  }
  $("listeners").tBodies[0].replaceChildren(...rows);
}

// ---- events and changes ---------------------------------------------------

function addTimeline(list, item, keep) {
  const empty = list.querySelector(".empty");
  if (empty) empty.remove();
  list.prepend(item);
  while (list.children.length > keep) list.lastChild.remove();
}

async function pollEvents() {
  const r = await api("/v1/events?after=" + lastEvent);
  const { events } = await r.json();
  for (const e of events) {
    lastEvent = Math.max(lastEvent, e.seq);
    addTimeline($("events"), el("li", { "data-kind": e.kind },
      el("time", {}, clock(e.at_unix_ms)), el("strong", {}, e.service || "certificate " + e.certificate), " ",
      el("span", { class: "badge" }, e.kind.replace(/_/g, " ")), " ", e.instance ? e.instance + ": " : "", e.detail),
    KEEP_EVENTS);
  }
}

function describeOp(op) {
  const target = op.name || op.service || "";
  const id = op.id ? "/" + op.id : "";
  return `${op.op} ${target}${id}`;
}

function showChange(data) {
  const ops = (data.change && data.change.ops) || [];
  const shown = ops.slice(0, 5).map(describeOp).join(", ") + (ops.length > 5 ? `, … (${ops.length} ops)` : "");
  addTimeline($("changes"), el("li", { "data-revision": String(data.revision) },
    el("time", {}, clock(Date.now())), el("strong", {}, "r" + data.revision), " ", shown), KEEP_CHANGES);
}

// Server-sent events over fetch (EventSource cannot send the token).
async function watch(from) {
  watchAbort = new AbortController();
  const r = await fetch("/v1/watch?from=" + from,
    { headers: { Authorization: "Bearer " + token }, signal: watchAbort.signal });
  if (r.status === 401) {
    signOut("the token was refused");
    return;
  }
  if (!r.ok || !r.body) throw new Error("watch: " + r.status);
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, end);
      buf = buf.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (!data || !/^event: change$/m.test(block)) continue;
      showChange(JSON.parse(data));
      refreshConfig().catch(() => {});
    }
  }
}

async function keepWatching(from) {
  for (;;) {
    try {
      await watch(from);
    } catch (e) {
      if (!token) return;
    }
    if (!token) return;
    await new Promise((ok) => setTimeout(ok, 2000));
    from = config ? config.revision : from;
  }
}

// ---- wiring ---------------------------------------------------------------

async function refreshStatus() {
  const r = await api("/v1/status");
  const status = await r.json();
  renderServices(status);
  renderListeners(status);
  $("state").textContent = "live";
  $("state").className = "badge health-up";
}

async function refreshConfig() {
  const r = await api("/v1/config");
  config = await r.json();
  renderRoutes();
}

function every(ms, f) {
  const tick = () => f().catch(() => {
    $("state").textContent = "reconnecting";
    $("state").className = "badge health-down";
  });
  tick();
  timers.push(setInterval(tick, ms));
}

async function start() {
  $("login").hidden = true;
  $("main").hidden = false;
  try {
    await refreshConfig();
  } catch (e) {
    return;
  }
  every(STATUS_MS, refreshStatus);
  every(CONFIG_MS, refreshConfig);
  every(EVENTS_MS, pollEvents);
  keepWatching(Math.max(0, config.revision - KEEP_CHANGES));
}

function signOut(why) {
  token = null;
  sessionStorage.removeItem("tidegate-token");
  for (const t of timers) clearInterval(t);
  timers = [];
  if (watchAbort) watchAbort.abort();
  $("main").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = why || "";
  $("state").textContent = "not connected";
  $("state").className = "badge";
}

function init() {
  const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  if (m) {
    try {
      sessionStorage.setItem("tidegate-token", decodeURIComponent(m[1]));
    } catch (e) {
      // A malformed fragment: ask for the token instead.
    }
    history.replaceState(null, "", location.pathname + location.search);
  }
  token = sessionStorage.getItem("tidegate-token");
  $("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const t = $("token").value.trim();
    if (!t) return;
    token = t;
    sessionStorage.setItem("tidegate-token", t);
    start();
  });
  if (token) start();
  else signOut("");
}

init();
