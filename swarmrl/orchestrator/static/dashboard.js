// The swarmrl dashboard: polls GET /v1/dashboard and draws it. Plain DOM and SVG, no library,
// nothing loaded from elsewhere. Every string from the server (worker names above all) is set
// as textContent, never parsed as HTML.
"use strict";

const POLL_MS = 2000;
const COLORS = ["#2563eb", "#d97706", "#059669", "#9333ea"];
const CHARTS = [
  { id: "reward", series: [["reward/mean", "reward"], ["reward/task_mean_all", "task accuracy (all groups)"]] },
  { id: "accuracy", series: [["eval/accuracy", "held-out accuracy"]] },
  { id: "length", series: [["length/mean", "mean length"], ["length/target_mean", "mean target"],
                           ["length/abs_error_mean", "|length - target|"]] },
  { id: "offpolicy", series: [["off_policy/mean", "mean"], ["off_policy/max", "max"]] },
  { id: "episodes", series: [["episode/turns_mean", "turns per episode"], ["episode/tool_calls_mean", "tool calls per episode"],
                             ["episode/tool_errors", "tool errors"], ["episode/observation_token_share", "observation token share"]] },
];
const SVG = "http://www.w3.org/2000/svg";

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function svgEl(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function fmt(x) {
  if (x === null || x === undefined) return "";
  const a = Math.abs(x);
  if (a >= 1000) return x.toFixed(0);
  if (a >= 10) return x.toFixed(1);
  return x.toFixed(a >= 1 ? 2 : 3);
}

function ago(seconds) {
  if (seconds < 90) return `${seconds.toFixed(0)} s ago`;
  if (seconds < 5400) return `${(seconds / 60).toFixed(0)} min ago`;
  return `${(seconds / 3600).toFixed(1)} h ago`;
}

function drawChart(spec, progress) {
  const svg = document.getElementById(`chart-${spec.id}`);
  const legend = document.getElementById(`legend-${spec.id}`);
  const width = svg.clientWidth || 400, height = svg.clientHeight || 180;
  const pad = { l: 42, r: 8, t: 8, b: 20 };
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.replaceChildren();
  legend.replaceChildren();
  const lines = spec.series.map(([key, label], i) => ({
    key, label, color: COLORS[i % COLORS.length],
    points: progress.filter((p) => typeof p[key] === "number").map((p) => [p.step, p[key]]),
  })).filter((s) => s.points.length > 0);
  const count = lines.reduce((n, s) => n + s.points.length, 0);
  svg.dataset.points = String(count);
  if (count === 0) {
    svg.append(svgEl("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" }));
    svg.lastChild.textContent = "no data yet";
    return;
  }
  const xs = lines.flatMap((s) => s.points.map((p) => p[0]));
  const ys = lines.flatMap((s) => s.points.map((p) => p[1]));
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 + 0.5; y1 += Math.abs(y1) * 0.1 + 0.5; }
  const sx = (x) => pad.l + ((x - x0) / (x1 - x0)) * (width - pad.l - pad.r);
  const sy = (y) => height - pad.b - ((y - y0) / (y1 - y0)) * (height - pad.t - pad.b);
  svg.append(svgEl("line", { x1: pad.l, y1: height - pad.b, x2: width - pad.r, y2: height - pad.b, class: "axis" }));
  svg.append(svgEl("line", { x1: pad.l, y1: pad.t, x2: pad.l, y2: height - pad.b, class: "axis" }));
  for (const y of [y0, (y0 + y1) / 2, y1]) {
    const t = svgEl("text", { x: pad.l - 4, y: sy(y) + 3, "text-anchor": "end" });
    t.textContent = fmt(y);
    svg.append(t);
  }
  for (const x of [x0, x1]) {
    const t = svgEl("text", { x: sx(x), y: height - 5, "text-anchor": x === x0 ? "start" : "end" });
    t.textContent = `step ${Math.round(x)}`;
    svg.append(t);
  }
  for (const s of lines) {
    const poly = svgEl("polyline", { stroke: s.color, points: s.points.map(([x, y]) => `${sx(x)},${sy(y)}`).join(" ") });
    poly.dataset.key = s.key;
    svg.append(poly);
    const item = el("span");
    const swatch = el("i");
    swatch.style.background = s.color;
    item.append(swatch, `${s.label}: ${fmt(s.points[s.points.length - 1][1])}`);
    legend.append(item);
  }
}

function renderRun(run) {
  const box = document.getElementById("run");
  box.replaceChildren();
  const parts = [
    ["run ", run.run_id.slice(0, 12)],
    [" · ", run.finished ? "finished" : "running"],
    [" · step ", `${run.next_step} / ${run.total_steps}`],
    [" · policy ", run.latest_version === null ? "none yet" : `v${run.latest_version}`],
    [" · async bound ", run.async_bound],
    [" · ", `${run.prompts_per_step} prompts × ${run.group_size}`],
  ];
  for (const [label, value] of parts) box.append(label, el("b", value));
}

// A key's evidence (calibrated runs, proofs/evidence.py): the closest of its sequential tests as
// a bar of score / bound (full = banned), every test in the cell's tooltip and its list.
function evidenceCell(tests) {
  const cell = el("td", null, "evidence");
  if (!tests || !tests.length) { cell.textContent = "no test"; cell.classList.add("muted"); return cell; }
  const share = (t) => (t.bound > 0 ? t.score / t.bound : 0);
  const sorted = [...tests].sort((a, b) => share(b) - share(a));
  const top = sorted[0];
  const pct = Math.max(0, Math.min(1, share(top))) * 100;
  const bar = el("span", null, "ev-bar");
  const fill = el("i", null, pct >= 100 ? "ev-fill ev-over" : pct >= 25 ? "ev-fill ev-warn" : "ev-fill");
  fill.style.width = `${pct.toFixed(1)}%`;
  bar.append(fill);
  cell.append(bar, el("span", `${pct.toFixed(0)}% ${top.engine}/${top.test}`, "ev-label"));
  cell.title = sorted.map((t) => `${t.engine} ${t.test}: ${fmt(t.score)} / ${fmt(t.bound)} ` +
                                 `(peak ${fmt(t.peak)}, ${t.groups} groups)`).join("\n");
  cell.dataset.share = (pct / 100).toFixed(4);
  return cell;
}

function renderWorkers(doc) {
  const body = document.querySelector("#workers tbody");
  body.replaceChildren();
  document.getElementById("workers-total").textContent = `(${doc.workers_total})`;
  doc.workers.forEach((w, i) => {
    const row = el("tr");
    row.dataset.fingerprint = w.fingerprint;
    if (w.banned) row.className = "banned";
    const why = Object.entries(w.rejections).sort((a, b) => b[1] - a[1]).map(([r, n]) => `${r} ${n}`).join(", ");
    const status = w.banned ? "banned" : w.trusted ? "trusted" : "ok";
    row.append(el("td", i + 1, "num"), el("td", w.fingerprint, "key"), el("td", w.name),
               el("td", w.accepted, "num"), el("td", w.validated, "num"), el("td", w.rejected, "num"),
               el("td", why), evidenceCell(w.evidence), el("td", status, `status status-${status}`),
               el("td", ago(w.last_seen_s)));
    body.append(row);
  });
}

function renderValidation(v) {
  const body = document.querySelector("#validation tbody");
  body.replaceChildren();
  const row = (k, val) => { const r = el("tr"); r.append(el("th", k), el("td", val, "num")); body.append(r); };
  row("mode", v.mode);
  for (const [state, n] of Object.entries(v.groups)) row(`groups ${state}`, n);
  const reasons = Object.entries(v.rejections).sort((a, b) => b[1] - a[1]);
  row("rejections", reasons.length ? reasons.map(([r, n]) => `${r} ${n}`).join(", ") : "none");
  if (v.limits) {
    row("limits", `measured on v${v.limits.measured_on} (${v.limits.dtype}, CPU kind ${v.limits.cpu}); ` +
        `engines ${v.limits.engines.join(", ") || "none"}`);
  }
  for (const [engine, d] of Object.entries(v.drift || {})) {
    row(`drift ${engine}`, `${d.alarm ? "ALARM: " : ""}${d.above} of ${d.window} above the calibrated ` +
        `${d.statistic} q90 (at most ${d.expected_at_most} expected)`);
  }
}

function renderVersions(versions) {
  const body = document.querySelector("#versions tbody");
  body.replaceChildren();
  for (const v of versions) {
    const r = el("tr");
    const size = v.bytes === null ? "" : `${(v.bytes / 1e6).toFixed(2)} MB`;
    r.append(el("td", `v${v.version}`), el("td", new Date(v.published * 1000).toLocaleTimeString()),
             el("td", size, "num"), el("td", v.adapter ? "LoRA adapter" : "full"));
    body.append(r);
  }
}

async function poll() {
  const footer = document.getElementById("updated");
  try {
    const response = await fetch("/v1/dashboard", { cache: "no-store" });
    if (!response.ok) throw new Error(`GET /v1/dashboard answered ${response.status}`);
    const doc = await response.json();
    renderRun(doc.run);
    for (const spec of CHARTS) drawChart(spec, doc.progress);
    renderWorkers(doc);
    renderValidation(doc.validation);
    renderVersions(doc.broadcast.versions);
    footer.className = "muted";
    footer.textContent = `updated ${new Date().toLocaleTimeString()} · refreshes every ${POLL_MS / 1000} s`;
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
    if (doc.run.finished) return;  // nothing will change any more
  } catch (err) {
    footer.className = "error";
    footer.textContent = `cannot reach the orchestrator (${err.message}); retrying`;
  }
  setTimeout(poll, POLL_MS);
}

poll();
