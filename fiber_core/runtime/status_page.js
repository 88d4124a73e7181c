"use strict";
// The status page's script: asks status.json every second and draws the run. No library:
// the charts are SVG drawn here. Tables show PAGE_ROWS rows at a time.
const token = new URLSearchParams(location.search).get("token") || "";
const SVG = "http://www.w3.org/2000/svg";
const PAGE_ROWS = 50;
const WINDOW_SECONDS = 600;
const COLORS = {starting: "#fdb022", initializing: "#fdb022", busy: "#12b76a", idle: "#d0d5dd",
                draining: "#f04438", retiring: "#98a2b3"};
const view = {page: {}, open: new Set(), last: null};  // the page of each table, the logs opened

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function duration(s) {
  if (s < 60) return s.toFixed(1) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function table(headers, rows, numeric, attrs) {
  const head = el("tr", {}, ...headers.map((h, i) => el("th", numeric.includes(i) ? {class: "num"} : {}, h)));
  const body = rows.map(r => el("tr", r.attrs, ...r.cells.map((c, i) => {
    if (c instanceof HTMLTableCellElement) return c;
    return el("td", numeric.includes(i) ? {class: "num"} : (r.classes && r.classes[i] ? {class: r.classes[i]} : {}), c);
  })));
  return el("table", attrs || {}, el("thead", {}, head), el("tbody", {}, ...body));
}

function redraw() {
  if (view.last) render(view.last);
}

// PAGE_ROWS of ``rows`` at a time, and buttons for the others.
function paged(key, rows) {
  const pages = Math.max(1, Math.ceil(rows.length / PAGE_ROWS));
  const page = Math.min(view.page[key] || 0, pages - 1);
  view.page[key] = page;
  let pager = null;
  if (pages > 1) {
    const go = to => { const b = el("button", {type: "button"}, to < page ? "previous" : "next");
      if (to < 0 || to >= pages) b.disabled = true;
      b.addEventListener("click", () => { view.page[key] = to; redraw(); });
      return b; };
    pager = el("div", {class: "pager muted", "data-pages": pages}, go(page - 1), go(page + 1),
      "rows " + (page * PAGE_ROWS + 1) + "-" + Math.min(rows.length, (page + 1) * PAGE_ROWS) + " of " + rows.length);
  }
  return {rows: rows.slice(page * PAGE_ROWS, (page + 1) * PAGE_ROWS), pager};
}

// A cell with the last line printed; a click shows them all (and hides them again).
function linesCell(key, lines) {
  const open = view.open.has(key);
  const td = el("td", {class: "lines", "data-lines": lines.length, "data-open": open ? "1" : "0",
                       title: lines.length ? "click: all the lines kept" : ""});
  if (open) td.append(el("pre", {class: "log"}, lines.join("\n")));
  else td.append(el("span", {class: "last"}, lines.length ? lines[lines.length - 1] : ""));
  td.addEventListener("click", () => { if (open) view.open.delete(key); else view.open.add(key); redraw(); });
  return td;
}

function meter(kind, fraction, text) {
  const fill = el("div", {class: "fill"});
  fill.style.width = (100 * Math.max(0, Math.min(1, fraction))).toFixed(1) + "%";
  return el("span", {class: "usage " + kind}, el("span", {class: "meter " + kind}, fill), text);
}

function spark(history) {  // [seconds ago, cpu, rss]: the CPU of the last minute
  const most = Math.max(100, ...history.map(h => h[1]));
  const oldest = Math.max(1, ...history.map(h => h[0]));
  const points = history.map(h => (60 * (1 - h[0] / oldest)).toFixed(1) + "," + (14 - 14 * h[1] / most).toFixed(1));
  return svg("svg", {class: "spark", width: 60, height: 14, viewBox: "0 0 60 14"},
    svg("polyline", {points: points.join(" "), fill: "none", stroke: "#12b76a", "stroke-width": 1}));
}

// Tasks per second over time: a bar per second (per minute before the last ten minutes).
function chart(points, age) {
  const W = 800, H = 100;
  const coarse = points.some(p => p[2] > 1);
  const span = coarse ? Math.max(...points.map(p => p[0])) : Math.min(Math.max(age, 10), WINDOW_SECONDS);
  const most = Math.max(1, ...points.map(p => p[1]));
  const TOP = 14;  // room for the scale above the bars, and for the times below them
  const node = svg("svg", {class: "chart", viewBox: "0 0 " + W + " " + (TOP + H + 14), "data-points": points.length,
                           "data-most": most});
  for (const [ago, rate, seconds] of points) {
    if (ago > span) continue;
    const h = H * rate / most, x = W * (1 - ago / span);
    node.append(svg("rect", {x: x.toFixed(1), y: (TOP + H - h).toFixed(1),
                             width: Math.max(Math.min(W * seconds / span, W - x), 1).toFixed(1), height: h.toFixed(1)},
                    svg("title", {}, rate + " tasks/s, " + duration(ago) + " ago")));
  }
  node.append(svg("text", {x: 3, y: 11}, most.toFixed(1) + " tasks/s"));
  node.append(svg("text", {x: 3, y: TOP + H + 12}, "-" + duration(span)));
  node.append(svg("text", {x: W - 3, y: TOP + H + 12, "text-anchor": "end"}, "now"));
  return node;
}

// One worker's states as coloured segments over the window, its end as a red (lost) or grey mark.
function track(t, span) {
  const W = 400;
  const node = svg("svg", {class: "track", viewBox: "0 0 " + W + " 14", preserveAspectRatio: "none"});
  const x = ago => W * (1 - Math.min(ago, span) / span);
  t.events.forEach(([ago, state], i) => {
    if (state === "lost" || state === "ended") {
      node.append(svg("rect", {x: Math.max(0, x(ago) - 2).toFixed(1), y: 0, width: 3, height: 14,
                               fill: state === "lost" ? "#b42318" : "#667085"}, svg("title", {}, state)));
      return;
    }
    const until = i + 1 < t.events.length ? t.events[i + 1][0] : 0;
    if (until >= span) return;
    node.append(svg("rect", {x: x(ago).toFixed(1), y: 2, width: Math.max(x(until) - x(ago), 0.5).toFixed(1),
                             height: 10, fill: COLORS[state] || "#98a2b3"},
                    svg("title", {}, state + " for " + duration(ago - until))));
  });
  return node;
}

function timeline(p) {
  const all = p.timeline || [];
  if (!all.length) return [];
  const span = Math.min(Math.max(10, ...all.map(t => t.started_ago)), WINDOW_SECONDS);
  const {rows, pager} = paged(p.id + "/timeline", all);
  const body = rows.map(t => {
    const end = t.end;
    const what = end ? (end.lost ? "lost: " + end.reason + " \u2014 " + end.description : "ended: " + end.reason)
      : (t.events.length ? t.events[t.events.length - 1][1] : "");
    return {attrs: {class: "timeline-row", "data-name": t.name, "data-end": end ? end.reason : "",
                    "data-lost": end && end.lost ? "1" : "0"},
            classes: [null, null, null, end && end.lost ? "state-lost" : null],
            cells: [t.name, t.host || "", el("td", {class: "track"}, track(t, span)), what]};
  });
  return [el("h3", {}, "Workers over the last " + duration(span) + " (" + all.length + ")"),
          table(["worker", "host", "timeline", "now"], body, [], {class: "timeline"}), ...(pager ? [pager] : [])];
}

function losses(p) {
  const log = p.loss_log || [];
  if (!log.length) return [];
  const rows = log.map(l => ({
    attrs: {class: "loss", "data-worker": l.worker, "data-reason": l.reason},
    classes: [null, null, "reason"],
    cells: [duration(l.ago) + " ago", l.worker, l.reason, l.description,
            linesCell(p.id + "/loss/" + l.worker, l.output)],
  }));
  return [el("h3", {}, "Losses (the last " + log.length + ")"),
          table(["when", "worker", "reason", "what happened", "its last lines"], rows, [], {class: "loss-log"})];
}

function workers(p) {
  const usage = p.workers.some(w => w.usage);
  const gpu = p.workers.some(w => w.usage && w.usage.gpu !== null && w.usage.gpu !== undefined);
  const cpuMost = Math.max(100, ...p.workers.map(w => w.usage ? w.usage.cpu : 0));
  const rssMost = Math.max(1, ...p.workers.map(w => w.usage ? w.usage.rss : 0));
  const {rows, pager} = paged(p.id + "/workers", p.workers);
  const body = rows.map(w => {
    const u = w.usage;
    const cells = [w.name, w.backend, w.host || "", w.id || "", w.state, duration(w.for_seconds), w.done, w.in_flight];
    if (usage) {
      const cpu = el("td", {class: "cpu"}, u ? meter("cpu", u.cpu / cpuMost, u.cpu.toFixed(0) + "%") : "-");
      if (w.usage_history && w.usage_history.length > 1) cpu.append(" ", spark(w.usage_history));
      cells.push(cpu, el("td", {class: "mem"}, u ? meter("mem", u.rss / rssMost, bytes(u.rss)) : "-"));
      if (gpu) {
        cells.push(el("td", {class: "gpu"}, u && u.gpu !== null && u.gpu !== undefined
          ? meter("gpu", u.gpu / 100, u.gpu.toFixed(0) + "%" + (u.gpu_memory !== null && u.gpu_memory !== undefined ? " \u00b7 " + bytes(u.gpu_memory) : ""))
          : "-"));
      }
    }
    cells.push(linesCell(p.id + "/worker/" + w.name, w.output || []));
    return {attrs: {class: "worker", "data-name": w.name, "data-state": w.state},
            classes: [null, null, null, null, "state-" + w.state], cells};
  });
  const headers = ["worker", "backend", "host", "id", "state", "for", "done", "in flight",
                   ...(usage ? ["CPU", "memory"] : []), ...(gpu ? ["GPU"] : []), "last lines"];
  return [el("div", {class: "scroll"}, table(headers, body, [6, 7], {class: "workers"})), ...(pager ? [pager] : [])];
}

function renderPool(p) {
  const t = p.tasks;
  const total = t.queued + t.running + t.done;
  const pct = total ? Math.floor(100 * t.done / total) : 0;
  const size = p.elastic ? p.size + " workers at most, " + p.min_size + " at least" : p.size + " workers";
  const card = el("section", {class: "pool", "data-pool": p.id});
  card.append(el("h2", {}, "Pool " + p.id + " \u2014 " + size + " \u00b7 " + p.backend + " \u00b7 " + p.state));
  const fill = el("div", {class: "fill"});
  fill.style.width = pct + "%";
  card.append(el("div", {class: "bar progress", "data-done": t.done, "data-total": total}, fill,
    el("div", {class: "label"}, total ? t.done + " of " + total + " tasks done (" + pct + "%)" : "no tasks yet")));
  const stats = el("div", {class: "stats"},
    el("span", {}, "queued " + t.queued), el("span", {}, "running " + t.running),
    el("span", {}, "done " + t.done), el("span", {}, "failed " + t.failed),
    el("span", {}, p.throughput.toFixed(1) + " tasks/s (last " + p.throughput_seconds + " s)"));
  if (typeof p.cost_per_hour === "number") {
    stats.append(el("span", {class: "cost"}, "costs " + (p.cost_currency || "$") + p.cost_per_hour.toFixed(2) + " per hour"));
  }
  card.append(stats);
  const lost = Object.entries(p.losses);
  if (lost.length) {
    card.append(el("div", {class: "losses"}, "workers lost: " +
      lost.map(([k, v]) => k + " " + v).join(", ") + (p.last_loss ? " \u2014 last: " + p.last_loss : "")));
  }
  if (p.error) card.append(el("div", {class: "losses"}, "failed: " + p.error));
  for (const c of p.calls) {
    card.append(el("div", {class: "call muted"}, c.call + ": " + c.units_done + " of " +
      (c.units === null ? "?" : c.units) + " units"));
  }
  card.append(el("h3", {}, "Throughput"), chart(p.throughput_history || [], p.age_seconds));
  card.append(el("h3", {}, "Workers (" + p.workers.length + ")"), ...workers(p));
  card.append(...timeline(p), ...losses(p));
  return card;
}

function render(s) {
  view.last = s;
  const r = s.run;
  document.title = "Fiber run " + r.id;
  document.getElementById("title").textContent = "Fiber run " + r.id;
  document.getElementById("run").textContent = r.program + " \u00b7 pid " + r.pid + " on " + r.host +
    " \u00b7 backend " + (r.backend || "-") + " \u00b7 up " + duration(r.now - r.started);
  document.getElementById("pools").replaceChildren(...(s.pools.length ? s.pools.map(renderPool)
    : [el("p", {class: "muted"}, "no pool")]));
  const procs = document.getElementById("processes");
  if (s.processes.length) {
    procs.replaceChildren(el("h2", {}, "Processes"), table(["process", "backend", "host", "id", "state"],
      s.processes.map(p => ({attrs: {class: "process"}, cells: [p.name, p.backend || "", p.host || "", p.id || "", p.state]})), []));
  } else {
    procs.replaceChildren();
  }
}

async function tick() {
  const conn = document.getElementById("conn");
  try {
    const response = await fetch("status.json", {headers: {"X-Fiber-Token": token}, cache: "no-store"});
    if (!response.ok) throw new Error("HTTP " + response.status);
    render(await response.json());
    conn.className = "muted";
    conn.textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    conn.className = "down";
    conn.textContent = "cannot reach the program (" + e.message + "): it may have ended";
  }
  setTimeout(tick, 1000);
}
tick();
