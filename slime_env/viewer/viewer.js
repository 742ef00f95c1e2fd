"use strict";
// The slime_env trajectory viewer. Data: the JSON in #data (see slime_env/viewer/__init__.py).
// Lazy by design: the list shows one page of rows, an episode's tokens are built only when it is opened.
(function () {
  const D = JSON.parse(document.getElementById("data").textContent);
  const EP = D.episodes;
  const PIECES = D.pieces || {};
  const SPECIAL = new Set(D.special || []);
  const PAGE = 100;
  const state = { env: "", status: "", agent: "", step: "", q: "", sort: "index", page: 0, selected: null,
                  tab: "turns", heat: false };

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else if (v !== null && v !== undefined) node.setAttribute(k, v);
    }
    for (const c of children.flat()) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return node;
  }
  const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
  const fmt = (x, d = 3) => (typeof x === "number" ? (Number.isInteger(x) ? String(x) : x.toFixed(d)) : "");
  const badge = (status) => el("span", { class: "badge st-" + status }, status);
  const uniq = (key) => [...new Set(EP.map((e) => e[key]).filter((v) => v !== null && v !== undefined && v !== ""))]
    .sort((a, b) => (typeof a === "number" && typeof b === "number" ? a - b : String(a).localeCompare(String(b))));

  // --- header, warnings, filters -------------------------------------------------------------------
  function header() {
    const counts = {};
    for (const e of EP) counts[e.status] = (counts[e.status] || 0) + 1;
    const top = document.getElementById("top");
    top.append(el("h1", {}, D.title),
      el("span", { class: "meta", id: "counts" }, `${EP.length} episodes · ` +
        Object.entries(counts).map(([k, v]) => `${v} ${k}`).join(" · ")),
      el("span", { class: "meta" }, "tokens: " + D.tokenizer),
      el("span", { class: "meta" }, (D.sources || []).join(", ")),
      el("span", { class: "meta" }, D.generated_at || ""));
    if ((D.warnings || []).length) {
      const box = document.getElementById("warnings");
      box.append(el("strong", {}, `${D.warnings.length} problem(s) reading the input; the rest is shown:`),
        el("ul", {}, D.warnings.map((w) => el("li", { class: "warning" }, w))));
    }
  }

  function filters() {
    const box = document.getElementById("filters");
    const select = (id, label, key, values) => {
      const s = el("select", { id, onchange: (ev) => { state[key] = ev.target.value; state.page = 0; renderList(); } },
        el("option", { value: "" }, "all"), values.map((v) => el("option", { value: String(v) }, String(v))));
      return el("label", {}, label, s);
    };
    box.append(select("f-env", "env", "env", uniq("env")), select("f-status", "status", "status", uniq("status")),
      select("f-agent", "agent", "agent", uniq("agent")), select("f-step", "step", "step", uniq("step")),
      el("label", {}, "search", el("input", { id: "f-q", type: "search", placeholder: "prompt, reason, task id",
        oninput: (ev) => { state.q = ev.target.value.toLowerCase(); state.page = 0; renderList(); } })),
      el("label", {}, "sort", el("select", { id: "f-sort", onchange: (ev) => { state.sort = ev.target.value; renderList(); } },
        [["index", "input order"], ["reward-desc", "reward ↓"], ["reward-asc", "reward ↑"], ["length-desc", "length ↓"],
         ["turns-desc", "turns ↓"], ["advantage-desc", "advantage ↓"]].map(([v, t]) => el("option", { value: v }, t)))));
  }

  function filtered() {
    const out = EP.filter((e) => (!state.env || e.env === state.env) && (!state.status || e.status === state.status) &&
      (!state.agent || e.agent === state.agent) && (!state.step || String(e.step) === state.step) &&
      (!state.q || (e.prompt + " " + e.reason + " " + (e.task_id || "")).toLowerCase().includes(state.q)));
    const [key, dir] = state.sort.split("-");
    if (key !== "index") {
      const field = key === "turns" ? "num_turns" : key;
      out.sort((a, b) => ((a[field] ?? -Infinity) - (b[field] ?? -Infinity)) * (dir === "desc" ? -1 : 1) || a.i - b.i);
    }
    return out;
  }

  // --- the list -------------------------------------------------------------------------------------
  function renderList() {
    const rows = filtered();
    const pages = Math.max(1, Math.ceil(rows.length / PAGE));
    state.page = Math.min(state.page, pages - 1);
    const table = document.getElementById("episodes");
    table.tHead.replaceChildren(el("tr", {}, ["#", "env", "step", "group", "agent", "status"].map((h) => el("th", {}, h)),
      ["reward", "turns", "tokens"].map((h) => el("th", { class: "num" }, h))));
    const body = table.tBodies[0];
    body.replaceChildren(...rows.slice(state.page * PAGE, (state.page + 1) * PAGE).map((e) =>
      el("tr", { "data-i": e.i, class: e.i === state.selected ? "selected" : "", onclick: () => select(e.i) },
        el("td", {}, e.i), el("td", {}, e.env), el("td", {}, e.step ?? ""), el("td", {}, e.group ?? ""),
        el("td", {}, e.agent), el("td", {}, badge(e.status)), el("td", { class: "num reward" }, fmt(e.reward)),
        el("td", { class: "num" }, e.num_turns), el("td", { class: "num" }, e.length))));
    document.getElementById("pager").replaceChildren(
      el("button", { id: "prev", onclick: () => { state.page--; renderList(); }, ...(state.page === 0 ? { disabled: "" } : {}) }, "‹ prev"),
      el("span", { id: "page-info" }, rows.length ? `${state.page * PAGE + 1}–${Math.min(rows.length, (state.page + 1) * PAGE)} of ${rows.length}` : "no episodes match"),
      el("button", { id: "next", onclick: () => { state.page++; renderList(); }, ...(state.page >= pages - 1 ? { disabled: "" } : {}) }, "next ›"));
  }

  function select(i) {
    state.selected = i;
    for (const tr of document.querySelectorAll("#episodes tbody tr")) tr.classList.toggle("selected", Number(tr.dataset.i) === i);
    renderDetail();
  }

  // --- one episode ----------------------------------------------------------------------------------
  function renderDetail() {
    const e = EP[state.selected];
    const detail = document.getElementById("detail");
    const siblings = groupOf(e);
    const agents = e.episode_id ? EP.filter((x) => x.episode_id === e.episode_id) : [e];
    const tabs = [["turns", "Turns"], ["tokens", "Tokens"]];
    if (siblings.length > 1) tabs.push(["group", `Group (${siblings.length})`]);
    if (agents.length > 1) tabs.push(["agents", `Agents (${agents.length})`]);
    if (!tabs.some(([k]) => k === state.tab)) state.tab = "turns";
    const summary = el("dl", { class: "summary" },
      el("dt", {}, "status"), el("dd", { id: "d-status" }, badge(e.status)),
      e.reason ? [el("dt", {}, "reason"), el("dd", { class: "reason", id: "d-reason" }, e.reason)] : [],
      el("dt", {}, "reward"), el("dd", { id: "d-reward" }, fmt(e.reward, 4) + (e.advantage !== undefined ? `  (advantage ${fmt(e.advantage)})` : "")),
      el("dt", {}, "turn rewards"), el("dd", { id: "d-turn-rewards" }, e.turn_rewards.map((r) => fmt(r)).join(", ") || "–"),
      el("dt", {}, "env · agent"), el("dd", {}, `${e.env || "–"} · ${e.agent}${e.role && e.role !== e.agent ? " (" + e.role + ")" : ""}`),
      el("dt", {}, "task"), el("dd", {}, `${e.task_id ?? "–"}; label ${JSON.stringify(e.label)}`),
      el("dt", {}, "tokens"), el("dd", {}, `${e.prompt_ids.length} prompt + ${e.length} response (${e.generated} generated)`),
      el("dt", {}, "timing"), el("dd", {}, Object.entries(e.timings).map(([k, v]) => `${k} ${fmt(v)}`).join(" · ") || "–"),
      el("dt", {}, "source"), el("dd", { class: "meta" }, e.where));
    const bar = el("div", { class: "tabs" }, tabs.map(([k, label]) =>
      el("button", { "data-tab": k, class: state.tab === k ? "active" : "", onclick: () => { state.tab = k; renderDetail(); } }, label)));
    const body = { turns: renderTurns, tokens: renderTokens, group: () => renderGroup(e, siblings),
                   agents: () => renderAgents(e, agents) }[state.tab](e);
    detail.replaceChildren(el("h2", {}, `Episode ${e.i}`), summary, bar, body);
  }

  function groupOf(e) {
    if (e.group === null || e.group === undefined) return [e];
    return EP.filter((x) => x.group === e.group && x.step === e.step && x.env === e.env && x.agent === e.agent);
  }

  function renderTurns(e) {
    let turn = 0;
    const box = el("div", { id: "turns" });
    if (!e.messages.length) box.append(el("p", { class: "hint" }, "This record has no messages (older format or a flat row); see the Tokens tab."));
    for (const m of e.messages) {
      const extra = [];
      if (m.role === "assistant") {
        extra.push(`turn ${turn}`);
        if (turn < e.turn_rewards.length) extra.push(`reward ${fmt(e.turn_rewards[turn])}`);
        turn++;
      }
      if (m.name) extra.push(`tool ${m.name}`);
      if (m.tool_call_id) extra.push(`id ${m.tool_call_id}`);
      box.append(el("div", { class: "msg " + m.role }, el("div", { class: "role" }, el("strong", {}, m.role), extra.map((x) => el("span", {}, x))),
        el("pre", {}, m.content)));
    }
    if (e.info && Object.keys(e.info).length) box.append(el("details", {}, el("summary", {}, "last info"), el("pre", {}, JSON.stringify(e.info, null, 1))));
    return box;
  }

  function showPiece(id) {
    const p = PIECES[id];
    if (p === undefined) return `⟨${id}⟩`;
    return esc(p).replace(/ /g, '<span class="ws">·</span>').replace(/\t/g, '<span class="ws">→</span>')
      .replace(/\r/g, '<span class="ws">␍</span>').replace(/\n/g, '<span class="ws">↵</span>\n');
  }

  function heat(lp) {
    const p = Math.exp(lp);
    return `hsl(${Math.round(120 * p)}, 75%, ${Math.round(72 + 10 * p)}%)`;
  }

  function renderTokens(e) {
    const kinds = new Array(e.response_ids.length).fill("unknown");
    const turns = new Array(e.response_ids.length).fill(0);
    for (const [turn, kind, start, end] of e.spans) for (let j = start; j < end && j < kinds.length; j++) { kinds[j] = kind; turns[j] = turn; }
    // a failed or infra_error episode never reaches the loss: its tokens are masked
    const failed = e.status === "failed" || e.status === "infra_error";
    const parts = [];
    e.prompt_ids.forEach((id, j) => parts.push(`<span class="tok k-prompt${SPECIAL.has(id) ? " special" : ""}" data-pos="${j}" data-id="${id}" data-kind="prompt" title="prompt #${j} · id ${id}">${showPiece(id)}</span>`));
    e.response_ids.forEach((id, j) => {
      let kind = kinds[j];
      if (failed && kind === "generated") kind = "masked";
      const lp = e.logprobs[j];
      const gen = kind === "generated" || kind === "offpolicy" || (kind === "masked" && e.mask[j]);
      const style = state.heat && gen ? ` style="background:${heat(lp)}"` : "";
      const title = `response #${j} · id ${id} · ${kind} · turn ${turns[j]} · mask ${e.mask[j]}` + (gen ? ` · logprob ${lp.toFixed(4)} (p=${Math.exp(lp).toFixed(3)})` : "");
      parts.push(`<span class="tok k-${kind}${SPECIAL.has(id) ? " special" : ""}" data-pos="${e.prompt_ids.length + j}" data-id="${id}" data-kind="${kind}" data-mask="${e.mask[j]}"` +
        `${gen ? ` data-lp="${lp}"` : ""}${style} title="${esc(title)}">${showPiece(id)}</span>`);
    });
    const strip = el("div", { class: "strip", id: "strip" });
    strip.innerHTML = parts.join("");
    const legend = el("div", { class: "legend" },
      [["prompt", "prompt"], ["generated", "generated (trained)"], ["inserted", "inserted by env/template"],
       ["offpolicy", "off-policy (mask 0)"], ["masked", "masked (failed episode)"]].map(([k, t]) =>
        el("span", {}, el("span", { class: "sw k-" + k }), " " + t)),
      el("label", {}, el("input", { type: "checkbox", id: "heat", ...(state.heat ? { checked: "" } : {}),
        onchange: (ev) => { state.heat = ev.target.checked; renderDetail(); } }), " log-prob heat map"));
    const drift = e.drift.length ? el("div", { class: "drift", id: "drift" }, el("strong", {}, "Template drift (strict mode): "),
      el("ul", {}, e.drift.map((d) => el("li", {}, d)))) : "";
    return el("div", {}, legend, drift, strip);
  }

  function lastAssistant(e) {
    const msgs = e.messages.filter((m) => m.role === "assistant");
    return msgs.length ? msgs[msgs.length - 1].content : "";
  }

  function renderGroup(e, members) {
    const mean = members.reduce((s, m) => s + m.reward, 0) / members.length;
    const grid = el("div", { class: "group-grid", id: "group" }, members.map((m) =>
      el("div", { class: "sample" + (m.i === e.i ? " current" : ""), "data-i": m.i, onclick: () => select(m.i) },
        el("div", {}, badge(m.status), ` #${m.i} reward `, el("strong", { class: "reward" }, fmt(m.reward)),
          ` adv `, el("span", { class: "advantage" }, fmt(m.advantage))),
        el("div", { class: "meta" }, `${m.num_turns} turns · ${m.length} tokens`),
        el("pre", {}, lastAssistant(m) || "(no assistant message)"))));
    const zero = members.every((m) => m.reward === members[0].reward);
    return el("div", {}, el("p", {}, `group ${e.group}${e.step !== null ? " · step " + e.step : ""} · mean reward ${fmt(mean)}` +
      (zero ? " · zero variance: every advantage is 0, this group teaches nothing" : "")), grid);
  }

  function renderAgents(e, members) {
    const byAgent = members.map((m) => ({ m, turns: m.messages.filter((x) => x.role === "assistant") }));
    const n = Math.max(...byAgent.map((a) => a.turns.length));
    const rows = [];
    for (let k = 0; k < n; k++) {
      rows.push(el("tr", {}, el("th", {}, `turn ${k}`), byAgent.map(({ m, turns }) =>
        el("td", {}, turns[k] ? [el("pre", {}, turns[k].content), el("div", { class: "meta" }, `reward ${fmt(m.turn_rewards[k] ?? 0)}`)] : ""))));
    }
    return el("table", { class: "agents", id: "agents" },
      el("thead", {}, el("tr", {}, el("th", {}, ""), byAgent.map(({ m }) => el("th", {}, el("a", { href: "#", onclick: (ev) => { ev.preventDefault(); select(m.i); } },
        `${m.agent}${m.role && m.role !== m.agent ? " (" + m.role + ")" : ""}`), " ", badge(m.status), ` reward ${fmt(m.reward)}`)))),
      el("tbody", {}, rows));
  }

  function report() {
    const R = D.report;
    if (!R) return;
    document.body.classList.add("has-report");
    const box = document.getElementById("report");
    box.append(el("h2", {}, "Training run"),
      el("div", { class: "facts", id: "facts" }, Object.entries(R.facts || {}).map(([k, v]) => el("span", {}, el("b", {}, k), " " + String(v ?? "–")))),
      el("div", { class: "charts", id: "charts" }, (R.images || []).map((img) =>
        el("figure", {}, el("img", { src: img.src, alt: img.title }), el("figcaption", {}, img.title)))),
      el("details", {}, el("summary", {}, "config"), el("pre", {}, JSON.stringify(R.config || {}, null, 1))),
      el("h2", {}, "Trajectories of the first and last steps"));
  }

  header();
  report();
  filters();
  renderList();
  if (EP.length) select(filtered()[0].i);
  document.body.dataset.ready = "1";
})();
