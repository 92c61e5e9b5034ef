// Titan live dashboard: polls /debug/dashboard, appends each answer to its charts (uPlot), marks spikes.
// The server describes its panels; this page only draws them, so `titan serve` and `titan router` share it.
"use strict";
(function () {
  const params = new URLSearchParams(location.search);
  const intervalMs = Math.max(100, Number(params.get("interval") || 1000));
  const maxPoints = Math.max(10, Number(params.get("points") || 600)); // bounded client-side history
  const colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                  "#7f7f7f", "#bcbd22"];
  const state = { polls: 0, errors: 0, last: null, panels: [], spikes: [], key: sessionStorage.getItem("titanKey") };
  window.titanDashboard = state; // for tests and the curious

  const status = document.getElementById("status");
  const form = document.getElementById("key-form");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    state.key = document.getElementById("key").value;
    sessionStorage.setItem("titanKey", state.key);
    form.style.display = "none";
  });

  function spikeBands(panel) {
    // A uPlot hook drawing each spike of this panel's metric as a shaded band.
    return (u) => {
      const ctx = u.ctx;
      ctx.save();
      ctx.fillStyle = "rgba(214, 39, 40, 0.15)";
      for (const spike of state.spikes) {
        if (spike.metric !== panel.spikes && !spike.metric.startsWith(`${panel.spikes}:`)) continue;
        const left = u.valToPos(spike.start, "x", true);
        const right = Math.max(u.valToPos(spike.end, "x", true), left + 2);
        ctx.fillRect(left, u.bbox.top, right - left, u.bbox.height);
      }
      ctx.restore();
    };
  }

  function build(panels) {
    const root = document.getElementById("panels");
    root.textContent = "";
    state.panels = panels.map((panel, number) => {
      const box = document.createElement("div");
      box.className = "panel";
      box.dataset.panel = String(number);
      const heading = document.createElement("h2");
      heading.textContent = panel.title;
      box.appendChild(heading);
      root.appendChild(box);
      const series = [{}].concat(panel.series.map((name, i) => ({
        label: name, stroke: colors[i % colors.length], width: 1.5, spanGaps: false,
      })));
      const data = [[]].concat(panel.series.map(() => []));
      const opts = {
        width: Math.max(420, box.clientWidth - 12), height: 200, series,
        scales: { x: { time: true } }, legend: { live: true },
        hooks: panel.spikes ? { draw: [spikeBands(panel)] } : {},
      };
      return { panel, data, plot: new uPlot(opts, data, box) };
    });
  }

  function showSpikes(spikes) {
    const body = document.querySelector("#spikes tbody");
    body.textContent = "";
    for (const spike of spikes.slice().reverse()) {
      const row = document.createElement("tr");
      row.className = "spike";
      const when = new Date(spike.start * 1000).toLocaleTimeString();
      const ratio = `${spike.peak_ms.toFixed(0)} / ${spike.baseline_ms.toFixed(0)} ms`;
      for (const text of [spike.id, when, spike.metric, ratio, spike.causes.join("; ")]) {
        const cell = document.createElement("td");
        cell.textContent = String(text);
        row.appendChild(cell);
      }
      body.appendChild(row);
    }
  }

  function same(a, b) {
    return JSON.stringify(a) === JSON.stringify(b);
  }

  async function poll() {
    const headers = state.key ? { Authorization: `Bearer ${state.key}` } : {};
    try {
      const answer = await fetch("debug/dashboard", { headers, cache: "no-store" });
      if (answer.status === 401) {
        form.style.display = "block";
        status.textContent = "this server needs its API key";
        return;
      }
      if (!answer.ok) {
        state.errors += 1;
        status.textContent = `the server answered ${answer.status}`;
        return;
      }
      const body = await answer.json();
      document.getElementById("title").textContent = body.title;
      document.title = body.title;
      if (!state.panels.length || !same(state.panels.map((p) => p.panel), body.panels)) build(body.panels);
      state.spikes = body.spikes || [];
      for (const view of state.panels) {
        view.data[0].push(body.time);
        view.panel.series.forEach((name, i) => {
          const value = body.values[name];
          view.data[i + 1].push(value === undefined ? null : value);
        });
        if (view.data[0].length > maxPoints) for (const column of view.data) column.shift();
        view.plot.setData(view.data);
      }
      showSpikes(state.spikes);
      state.polls += 1;
      state.last = body;
      status.textContent = `updated ${new Date(body.time * 1000).toLocaleTimeString()} · window ` +
        `${body.window_s} s · ${state.spikes.length} spike(s)`;
    } catch (error) {
      state.errors += 1;
      status.textContent = `cannot reach the server (${error})`;
    }
  }

  async function loop() {
    await poll();
    setTimeout(loop, intervalMs);
  }
  loop();
})();
