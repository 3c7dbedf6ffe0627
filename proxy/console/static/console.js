// clawrl console: the live overview (server-sent events + uPlot) and live turn lists.
// No framework and no build step; pages work without this script, it only keeps them live.
"use strict";

(function () {
  const page = document.body.dataset.page;

  function fmt(v, digits) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    return typeof v === "number" && digits !== undefined ? v.toFixed(digits) : String(v);
  }

  function signed(v) {
    if (v === null || v === undefined) return "–";
    return (v > 0 ? "+" : "") + v.toFixed(2);
  }

  // --- overview: numbers, reward-by-version table and charts ---------------------------
  let meanChart = null;
  let countChart = null;

  function chartData(rows) {
    const xs = rows.map((_, i) => i);
    const mean = rows.map((r) => r.mean);
    const hi = rows.map((r) => (r.mean === null ? null : r.mean + (r.std || 0)));
    const lo = rows.map((r) => (r.mean === null ? null : r.mean - (r.std || 0)));
    const counts = ["positive", "neutral", "negative", "abstained", "hints"].map((k) => rows.map((r) => r[k]));
    return { labels: rows.map((r) => (r.version === null ? "?" : /^\d+$/.test(r.version) ? "v" + r.version : r.version)), mean: [xs, mean, hi, lo], counts: [xs, ...counts] };
  }

  function makeChart(el, title, series, yRange, labels, data) {
    const width = Math.max(320, el.clientWidth - 16);
    return new uPlot({
      title: title, width: width, height: 240,
      scales: { x: { time: false, range: (u, min, max) => [min - 0.5, max + 0.5] }, y: yRange ? { range: yRange } : {} },
      axes: [{ incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500], values: (u, vals) => vals.map((v) => labels.current[v] ?? "") }, {}],
      series: [{ label: "version", value: (u, v) => (v === null ? "" : labels.current[v] ?? "") }].concat(series),
    }, data, el);
  }

  function drawCharts(rows) {
    const host = document.getElementById("reward-chart");
    if (!host || typeof uPlot === "undefined") return;
    const d = chartData(rows);
    if (meanChart === null) {
      host.textContent = "";
      const a = document.createElement("div");
      const b = document.createElement("div");
      host.append(a, b);
      const labels = { current: d.labels };
      meanChart = makeChart(a, "mean reward ± sd", [
        { label: "mean", stroke: "#2457c5", width: 2, points: { show: true, size: 6 }, value: (u, v) => signed(v) },
        { label: "+1 sd", stroke: "#9db3e6", dash: [4, 4], value: (u, v) => signed(v) },
        { label: "−1 sd", stroke: "#9db3e6", dash: [4, 4], value: (u, v) => signed(v) },
      ], [-1, 1], labels, d.mean);
      countChart = makeChart(b, "judged turns", [
        { label: "+1", stroke: "#268b22", points: { show: true } },
        { label: "0", stroke: "#8a939c", points: { show: true } },
        { label: "−1", stroke: "#c62d2a", points: { show: true } },
        { label: "abstained", stroke: "#c9a227", dash: [2, 3], points: { show: true } },
        { label: "hints", stroke: "#7b4cc2", dash: [6, 3], points: { show: true } },
      ], null, labels, d.counts);
      meanChart.labels = labels;
      countChart.labels = labels;
    } else {
      meanChart.labels.current = d.labels;
      meanChart.setData(d.mean);
      countChart.setData(d.counts);
    }
  }

  function fillTable(rows) {
    const body = document.querySelector("#reward-table tbody");
    if (!body) return;
    body.textContent = "";
    for (const r of rows) {
      const tr = document.createElement("tr");
      const cells = [r.version === null ? "?" : r.version, r.turns, r.judged, signed(r.mean), fmt(r.std, 2),
        r.positive, r.neutral, r.negative, r.abstained, r.hints];
      for (const c of cells) {
        const td = document.createElement("td");
        td.textContent = String(c);
        tr.append(td);
      }
      body.append(tr);
    }
  }

  function showOverview(data) {
    const values = {
      requests_per_s: fmt(data.requests_per_s, 2), turns: fmt(data.turns), turns_last_minute: fmt(data.turns_last_minute),
      judge_backlog: fmt(data.judge_backlog), reward_latency_p50_s: fmt(data.reward_latency_p50_s, 2),
      reward_latency_p95_s: fmt(data.reward_latency_p95_s, 2),
      trainer_step: data.trainer_step ? fmt(data.trainer_step.step) : "–", serving_version: fmt(data.serving_version),
    };
    for (const [k, v] of Object.entries(values)) {
      const el = document.querySelector(`[data-stat="${k}"]`);
      if (el) el.textContent = v;
    }
    if (data.reward_by_version.length) fillTable(data.reward_by_version);
    drawCharts(data.reward_by_version);
  }

  // --- turns: swap in the newest rows when turns or judgments arrive ---------------------
  let turnSignature = null;

  async function refreshTurns(data) {
    const table = document.getElementById("turns");
    if (!table || !table.dataset.live) return;
    const judged = data.reward_by_version.reduce((n, r) => n + r.judged, 0);
    const signature = `${data.latest_turn_id}/${judged}/${data.judge_backlog}`;
    // The first event refreshes too: turns stored between the page load and it show up.
    if (signature === turnSignature) return;
    turnSignature = signature;
    const resp = await fetch("/console/turns/rows" + window.location.search, { credentials: "same-origin" });
    if (!resp.ok) return;
    const seen = new Set(Array.from(table.querySelectorAll("tr[data-turn]")).map((tr) => tr.dataset.turn));
    table.querySelector("tbody").innerHTML = await resp.text();
    for (const tr of table.querySelectorAll("tr[data-turn]")) {
      if (!seen.has(tr.dataset.turn)) tr.classList.add("fresh");
    }
  }

  function listen(onData) {
    if (typeof EventSource === "undefined") return;
    const badge = document.getElementById("live");
    const source = new EventSource("/console/events");
    source.addEventListener("overview", (ev) => {
      if (badge) badge.classList.remove("off");
      onData(JSON.parse(ev.data));
    });
    source.addEventListener("error", () => { if (badge) badge.classList.add("off"); });
    window.addEventListener("pagehide", () => source.close());
  }

  document.addEventListener("DOMContentLoaded", () => {
    if (page === "overview") {
      const initial = document.getElementById("overview-data");
      if (initial) showOverview(JSON.parse(initial.textContent));
      listen(showOverview);
    } else if (page === "turns") {
      listen((data) => { refreshTurns(data).catch(() => {}); });
    }
  });
})();
