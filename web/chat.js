// chatserve chat UI: one websocket (docs/protocol.md), no build step, no external assets.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const el = {
    messages: $("messages"), empty: $("empty"), input: $("input"), send: $("send"), stop: $("stop"),
    newChat: $("new-chat"), status: $("status"), model: $("model"), error: $("error"),
    settingsToggle: $("settings-toggle"), settingsPanel: $("settings-panel"), temperature: $("temperature"),
    topP: $("top-p"), maxTokens: $("max-tokens"), speculation: $("speculation"), draftName: $("draft-name"),
    specMethod: $("spec-method"),
  };
  // spec_method null: the server's default (the first of its `spec_methods`)
  const DEFAULTS = { temperature: 0.7, top_p: 0.95, max_tokens: 512, speculation: true, spec_method: null };
  const state = {
    ws: null, ready: false, retries: 0, retryTimer: null,
    transcript: [],        // what this page has shown: [{role, content}], re-sent after a reconnect
    needsHistory: false,   // the server lost the conversation (new connection): next turn sends `messages`
    running: null,         // {id, user, node, text, tokens, startedAt, renderQueued}
    numTurns: 0,
    maxTokensLimit: 4096,
    specMethods: [],       // what the server runs (ready.spec_methods), its default first
    specLabels: {},        // method -> how to name it (ready.spec_method_labels)
    settings: loadSettings(),
  };

  // ---------------------------------------------------------------- connection

  function apiKey() {
    const fromUrl = new URLSearchParams(location.search).get("api_key");
    if (fromUrl) {  // keep it for reloads, but out of the address bar and the history
      sessionStorage.setItem("chatserve.api_key", fromUrl);
      history.replaceState(null, "", location.pathname);
    }
    return sessionStorage.getItem("chatserve.api_key");
  }

  function connect() {
    clearTimeout(state.retryTimer);
    setStatus("connecting", state.retries ? "Reconnecting…" : "Connecting…");
    const ws = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws`);
    state.ws = ws;
    ws.onopen = () => {
      const key = apiKey();
      if (key) send({ type: "auth", api_key: key });
    };
    ws.onmessage = (event) => {
      let message;
      try { message = JSON.parse(event.data); } catch { return showError("The server sent something unreadable."); }
      handle(message);
    };
    ws.onclose = (event) => onClose(ws, event);
  }

  // Why the server closed the socket (close codes in docs/protocol.md); all but 1008 retry.
  const CLOSE_REASONS = {
    1001: { status: "Server shutting down", message: "The server is shutting down. This page reconnects when it is back." },
    1012: { status: "Server restarting", message: "The server is restarting. This page reconnects when it is back." },
    1013: { status: "Server busy", message: "The server has too many connections open. Retrying…" },
    4008: { status: "Fell behind", message: "This page fell too far behind the reply stream and was disconnected. Reconnecting…" },
  };

  function onClose(ws, event) {
    if (ws !== state.ws) return;
    state.ready = false;
    const why = CLOSE_REASONS[event.code];
    if (state.running) endTurn({ note: why ? why.status.toLowerCase() : "connection lost", keep: true });
    updateControls();
    if (event.code === 1008) {  // refused (origin, API key): retrying would not help
      setStatus("offline", "Disconnected");
      return;
    }
    if (why) showError(why.message);
    const delay = Math.min(10000, 500 * 2 ** state.retries) * (0.8 + 0.4 * Math.random());
    state.retries += 1;
    const label = `${why ? `${why.status} · r` : "R"}econnecting in ${Math.ceil(delay / 1000)}s…`;
    setStatus("connecting", label);
    state.retryTimer = setTimeout(connect, delay);
  }

  function send(message) {
    if (!state.ws || state.ws.readyState !== WebSocket.OPEN) return false;
    state.ws.send(JSON.stringify(message));
    return true;
  }

  function handle(m) {
    const turn = state.running;
    switch (m.type) {
      case "ready":
        state.ready = true;
        state.retries = 0;
        state.needsHistory = state.transcript.length > 0;
        state.maxTokensLimit = m.max_tokens_limit || state.maxTokensLimit;
        el.model.textContent = m.draft ? `${m.model} + ${m.draft}` : m.model;
        el.draftName.textContent = m.draft ? `(${m.draft})` : "(no draft model)";
        state.specMethods = m.spec_methods || [];
        state.specLabels = m.spec_method_labels || {};
        el.speculation.disabled = state.specMethods.length === 0;
        showMethods();
        el.maxTokens.max = state.maxTokensLimit;
        setStatus("online", "Connected");
        hideError();
        sendSettings();
        break;
      case "delta":
        if (!turn || m.id !== turn.id) return;
        turn.text += m.text;
        turn.tokens += m.num_tokens;
        queueRender(turn);
        break;
      case "done":
        if (!turn || m.id !== turn.id) return;
        // an abort nobody asked for: the server ended it (shutting down; its close message follows)
        endTurn({ stats: m.stats, note: m.finish_reason === "abort" ? (turn.isCancelled ? "stopped" : "interrupted") :
          m.finish_reason === "length" ? "max tokens" : null, keep: true });
        break;
      case "error":
        if (turn && m.id === turn.id) endTurn({ error: m.message, keep: false });
        else if (m.code === "unauthorized") showError("This server needs an API key: open it as /?api_key=YOUR_KEY");
        else if (m.code !== "shutting_down") showError(m.message);  // the close that follows says it
        break;
      default:  // "settings" and "reset" acknowledgements need nothing
        break;
    }
  }

  // ---------------------------------------------------------------- turns

  function sendTurn() {
    const text = el.input.value;
    if (!text.trim() || state.running || !state.ready) return;
    const id = `t${++state.numTurns}`;
    const user = { role: "user", content: text };
    const message = state.needsHistory
      ? { type: "chat", id, messages: [...state.transcript, user] }
      : { type: "chat", id, content: text };
    message.params = speculationParams();
    if (!send(message)) return;
    state.needsHistory = false;
    hideError();
    const userNode = addMessage("user");
    userNode.querySelector(".bubble").textContent = text;
    const node = addMessage("assistant");
    node.classList.add("streaming");
    node.querySelector(".content").innerHTML = '<span class="typing"><i></i><i></i><i></i></span>';
    state.running = { id, user, userNode, node, text: "", tokens: 0, startedAt: performance.now() };
    el.input.value = "";
    autosize();
    updateControls();
    scrollToBottom(true);
  }

  // keep: the server kept this turn in its conversation (done), so the page keeps it too.
  function endTurn({ stats = null, note = null, error = null, keep }) {
    const turn = state.running;
    state.running = null;
    turn.node.classList.remove("streaming");
    render(turn);
    const body = turn.node.querySelector(".body");
    if (error) {
      turn.userNode.classList.add("failed");
      const line = document.createElement("div");
      line.className = "msg-error";
      line.textContent = error;
      body.appendChild(line);
      if (!turn.text) turn.node.querySelector(".content").textContent = "";
    } else if (keep) {
      state.transcript.push(turn.user);
      if (turn.text) state.transcript.push({ role: "assistant", content: turn.text });
    }
    if (stats || note) body.appendChild(statsLine(stats, note, turn));
    updateControls();
    scrollToBottom(false);
    el.input.focus();
  }

  function statsLine(stats, note, turn) {
    const line = document.createElement("div");
    line.className = "stats";
    line.dataset.testid = "stats";
    const add = (text, cls) => {
      const chip = document.createElement("span");
      chip.textContent = text;
      if (cls) chip.className = cls;
      line.appendChild(chip);
    };
    if (stats && stats.ttft_ms != null) add(`TTFT ${Math.round(stats.ttft_ms)} ms`);
    const generated = stats ? stats.generated_tokens : turn.tokens;
    if (stats && stats.tpot_ms) add(`${(1000 / stats.tpot_ms).toFixed(1)} tok/s`);
    if (stats && stats.spec_method) add(methodLabel(stats.spec_method));
    if (stats && stats.acceptance_rate != null) add(`${Math.round(100 * stats.acceptance_rate)}% accepted`);
    if (stats && stats.mean_accepted_length) add(`${stats.mean_accepted_length.toFixed(2)} tok/step`);
    add(`${generated} tokens`);
    if (stats && stats.cached_tokens) add(`${stats.cached_tokens} cached`);
    if (note) add(note, "tag");
    return line;
  }

  function newChat() {
    if (state.running) {
      state.running.node.classList.remove("streaming");
      state.running = null;
    }
    send({ type: "reset" });  // also cancels a running turn on the server
    state.transcript = [];
    state.needsHistory = false;
    el.messages.querySelectorAll(".msg").forEach((n) => n.remove());
    el.empty.hidden = false;
    hideError();
    updateControls();
    el.input.focus();
  }

  // ---------------------------------------------------------------- rendering

  function addMessage(role) {
    el.empty.hidden = true;
    const node = document.createElement("div");
    node.className = `msg ${role}`;
    node.dataset.testid = `msg-${role}`;
    node.innerHTML = role === "user"
      ? '<div class="bubble"></div>'
      : '<div class="avatar" aria-hidden="true"></div><div class="body"><div class="content"></div></div>';
    el.messages.appendChild(node);
    return node;
  }

  function queueRender(turn) {
    if (turn.renderQueued) return;
    turn.renderQueued = true;
    requestAnimationFrame(() => {
      turn.renderQueued = false;
      const stick = nearBottom();
      render(turn);
      if (stick) scrollToBottom(false);
    });
  }

  function render(turn) {
    if (turn.text) turn.node.querySelector(".content").innerHTML = renderMarkdown(turn.text);
  }

  const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) =>
    ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);

  // ``` fences become code blocks (an unclosed fence while streaming too); `inline` and **bold** in prose.
  function renderMarkdown(text) {
    const parts = [];
    const fence = /```([^\n`]*)\n?([\s\S]*?)(?:```|$)/g;
    let last = 0;
    for (const m of text.matchAll(fence)) {
      if (m.index > last) parts.push(renderProse(text.slice(last, m.index)));
      const lang = escapeHtml(m[1].trim() || "code");
      parts.push(`<div class="code"><div class="code-head"><span>${lang}</span>` +
        `<button type="button" class="copy">Copy</button></div><pre><code>${escapeHtml(m[2])}</code></pre></div>`);
      last = m.index + m[0].length;
    }
    if (last < text.length) parts.push(renderProse(text.slice(last)));
    return parts.join("");
  }

  // Paragraphs at blank lines, "- " / "1. " lists, "#" headings; anything else stays as typed.
  function renderProse(text) {
    const trimmed = text.replace(/^\n+/, "").replace(/\n+$/, "");
    if (!trimmed) return "";
    const blocks = [];
    let lines = [], list = null;
    const endParagraph = () => { if (lines.length) blocks.push(`<p>${lines.join("\n")}</p>`); lines = []; };
    const endList = () => {
      if (list) blocks.push(`<${list.tag}${list.start}>${list.items.map((i) => `<li>${i}</li>`).join("")}</${list.tag}>`);
      list = null;
    };
    for (const line of trimmed.split("\n")) {
      const item = line.match(/^\s*(?:([-*•])|(\d+)[.)])\s+(.*)$/);
      const heading = line.match(/^#{1,6}\s+(.*)$/);
      if (item) {
        endParagraph();
        const tag = item[1] ? "ul" : "ol";
        if (!list || list.tag !== tag) {
          endList();
          list = { tag, start: item[2] && item[2] !== "1" ? ` start="${item[2]}"` : "", items: [] };
        }
        list.items.push(renderInline(item[3]));
      } else if (heading) {
        endParagraph();
        endList();
        blocks.push(`<p class="heading">${renderInline(heading[1])}</p>`);
      } else if (!line.trim()) {
        endParagraph();
        endList();
      } else if (list && /^\s/.test(line)) {  // an indented line continues the last item
        list.items[list.items.length - 1] += ` ${renderInline(line.trim())}`;
      } else {
        endList();
        lines.push(renderInline(line));
      }
    }
    endParagraph();
    endList();
    return `<div class="prose">${blocks.join("")}</div>`;
  }

  function renderInline(text) {
    return escapeHtml(text)
      .replace(/`([^`\n]+)`/g, '<code class="inline">$1</code>')
      .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>");
  }

  const nearBottom = () => el.messages.scrollHeight - el.messages.scrollTop - el.messages.clientHeight < 80;
  function scrollToBottom(force) {
    if (force || nearBottom()) el.messages.scrollTop = el.messages.scrollHeight;
  }

  // ---------------------------------------------------------------- chrome: status, errors, settings

  function setStatus(kind, label) {
    el.status.dataset.state = kind;
    el.status.querySelector(".label").textContent = label;
  }

  let errorTimer = null;
  function showError(message) {
    el.error.textContent = message;
    el.error.hidden = false;
    clearTimeout(errorTimer);
    errorTimer = setTimeout(hideError, 8000);
  }
  function hideError() { el.error.hidden = true; }

  function updateControls() {
    const running = Boolean(state.running);
    el.stop.hidden = !running;
    el.send.hidden = running;
    el.send.disabled = !state.ready || !el.input.value.trim();
  }

  function loadSettings() {
    try { return { ...DEFAULTS, ...JSON.parse(localStorage.getItem("chatserve.settings") || "{}") }; } catch { return { ...DEFAULTS }; }
  }

  function showSettings() {
    const s = state.settings;
    el.temperature.value = s.temperature;
    el.topP.value = s.top_p;
    el.maxTokens.value = s.max_tokens;
    el.speculation.checked = s.speculation;
    showMethods();
    $("temperature-value").textContent = Number(s.temperature).toFixed(2);
    $("top-p-value").textContent = Number(s.top_p).toFixed(2);
  }

  function readSettings() {
    const maxTokens = Math.max(1, Math.min(state.maxTokensLimit, parseInt(el.maxTokens.value, 10) || DEFAULTS.max_tokens));
    state.settings = {
      temperature: Number(el.temperature.value), top_p: Number(el.topP.value),
      max_tokens: maxTokens, speculation: el.speculation.checked,
      spec_method: el.specMethod.value || state.settings.spec_method,
    };
    localStorage.setItem("chatserve.settings", JSON.stringify(state.settings));
    showSettings();
    sendSettings();
  }

  function sendSettings() {
    const params = { ...state.settings, max_tokens: Math.min(state.settings.max_tokens, state.maxTokensLimit) };
    delete params.speculation;
    delete params.spec_method;
    send({ type: "settings", params: { ...params, ...speculationParams() } });
  }

  // The saved method if this server runs it, else the server's default (null: no speculation).
  function chosenMethod() {
    const saved = state.settings.spec_method;
    return state.specMethods.includes(saved) ? saved : state.specMethods[0] || null;
  }

  function methodLabel(name) {
    return state.specLabels[name] || name;
  }

  // One option per method the server runs, named as the server names it.
  function showMethods() {
    el.specMethod.replaceChildren(...state.specMethods.map((name) => {
      const label = methodLabel(name);
      return new Option(label.charAt(0).toUpperCase() + label.slice(1), name);
    }));
    el.specMethod.value = chosenMethod() || "";
    el.specMethod.disabled = state.specMethods.length < 2 || !el.speculation.checked;
  }

  // Speculation on/off and method, as this server can run them: sent with the settings and each turn.
  function speculationParams() {
    if (el.speculation.disabled) return {};
    const params = { speculation: state.settings.speculation };
    if (chosenMethod()) params.spec_method = chosenMethod();
    return params;
  }

  function autosize() {
    el.input.style.height = "auto";
    el.input.style.height = `${Math.min(el.input.scrollHeight, 200)}px`;
  }

  async function copyCode(button) {
    const code = button.closest(".code").querySelector("code").textContent;
    try {
      await navigator.clipboard.writeText(code);
    } catch {  // no clipboard API off https/localhost
      const area = Object.assign(document.createElement("textarea"), { value: code });
      document.body.appendChild(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = "Copy"; }, 1200);
  }

  // ---------------------------------------------------------------- events

  $("composer").addEventListener("submit", (e) => { e.preventDefault(); sendTurn(); });
  el.input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); sendTurn(); }
  });
  el.input.addEventListener("input", () => { autosize(); updateControls(); });
  el.stop.addEventListener("click", () => {
    if (state.running && send({ type: "cancel", id: state.running.id })) state.running.isCancelled = true;
  });
  el.newChat.addEventListener("click", newChat);
  el.settingsToggle.addEventListener("click", () => {
    const open = el.settingsPanel.hidden;
    el.settingsPanel.hidden = !open;
    el.settingsToggle.setAttribute("aria-expanded", String(open));
  });
  document.addEventListener("click", (e) => {
    if (!el.settingsPanel.hidden && !el.settingsPanel.contains(e.target) && !el.settingsToggle.contains(e.target)) {
      el.settingsPanel.hidden = true;
      el.settingsToggle.setAttribute("aria-expanded", "false");
    }
  });
  for (const input of [el.temperature, el.topP]) input.addEventListener("input", readSettings);
  for (const input of [el.maxTokens, el.speculation, el.specMethod]) input.addEventListener("change", readSettings);
  el.messages.addEventListener("click", (e) => {
    const button = e.target.closest("button.copy");
    if (button) copyCode(button);
  });
  window.addEventListener("online", () => { if (!state.ready) connect(); });

  showSettings();
  updateControls();
  connect();
  el.input.focus();
})();
