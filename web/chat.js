// chatserve chat UI: one websocket (docs/protocol.md) and the turns on it. Conversations are kept in
// IndexedDB (store.js), listed by sidebar.js, drawn by messages.js and markdown.js; the sampling
// settings are settings.js's. No build step.

import * as store from "./store.js";
import { renderMarkdown } from "./markdown.js";
import { messageNode, openEditor, setSpecView } from "./messages.js";
import { buildFields, loadSettings, readFields, samplingParams, saveSettings, showFields } from "./settings.js";
import { createConnection } from "./connection.js";
import { createSidebar } from "./sidebar.js";

const $ = (id) => document.getElementById(id);
const el = {
  messages: $("messages"), empty: $("empty"), input: $("input"), send: $("send"), stop: $("stop"),
  newChat: $("new-chat"), status: $("status"), model: $("model"), error: $("error"),
  settingsToggle: $("settings-toggle"), settingsPanel: $("settings-panel"), speculation: $("speculation"),
  draftName: $("draft-name"), specMethod: $("spec-method"), system: $("system-prompt"),
  sidebar: $("sidebar"), sidebarToggle: $("sidebar-toggle"), announcer: $("announcer"),
};
const DRAFT_KEY = "chatserve.draft";  // the composer's unsent text, kept across reloads

const state = {
  ready: false,          // a `ready` came on the open socket
  conv: store.newConversation(),  // the open conversation; saved once it has a message
  running: null,         // {id, node, text, tokens, numTokens, isCancelled, renderQueued}
  numTurns: 0,
  maxTokensLimit: 4096,
  defaults: {},          // the server's value of each setting (ready.defaults)
  specMethods: [],       // what the server runs (ready.spec_methods), its default first
  specLabels: {},        // method -> how to name it (ready.spec_method_labels)
  settings: loadSettings(),
};

// ---------------------------------------------------------------- server messages

// What the page does when the socket closes (connection.js reconnects): a running turn ends.
function onClosed(why) {
  state.ready = false;
  if (state.running) endTurn({ note: why ? why.status.toLowerCase() : "connection lost", keep: true });
  updateControls();
}

const connection = createConnection({ onMessage: handle, onClosed, setStatus, showError });
const send = connection.send;

function handle(m) {
  const turn = state.running;
  switch (m.type) {
    case "ready":
      state.ready = true;
      connection.markReady();
      state.maxTokensLimit = m.max_tokens_limit || state.maxTokensLimit;
      state.defaults = { ...m.defaults, ...m.settings };
      el.model.textContent = m.draft ? `${m.model} + ${m.draft}` : m.model;
      el.draftName.textContent = m.draft ? `(${m.draft})` : "(no draft model)";
      state.specMethods = m.spec_methods || [];
      state.specLabels = m.spec_method_labels || {};
      el.speculation.disabled = state.specMethods.length === 0;
      showSettings();
      setStatus("online", "Connected");
      hideError();
      break;
    case "delta":
      if (!turn || m.id !== turn.id) return;
      turn.text += m.text;
      turn.numTokens += m.num_tokens;
      if (m.tokens) turn.tokens.push(...m.tokens);
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

// What the model sees: the system prompt, then the conversation's messages.
function wireMessages() {
  const messages = state.conv.messages.map(({ role, content }) => ({ role, content }));
  return state.conv.system.trim() ? [{ role: "system", content: state.conv.system }, ...messages] : messages;
}

// Ask for a reply to the conversation as it stands (its last message is the user's), or with
// isContinue, for more of the last reply (its last message is the assistant's).
function startTurn(isContinue = false) {
  const id = `t${++state.numTurns}`;
  const params = { ...samplingParams(state.settings, state.maxTokensLimit), ...speculationParams() };
  const message = { type: "chat", id, messages: wireMessages(), params };
  if (isContinue) message.continue = true;
  if (!send(message)) return false;
  hideError();
  state.running = { id, text: "", tokens: [], numTokens: 0, base: "" };
  if (isContinue) {
    const last = state.conv.messages.at(-1);
    Object.assign(state.running, { continues: last, base: last.content, tokens: [...(last.tokens || [])],
      node: el.messages.querySelector(`.msg[data-index="${state.conv.messages.length - 1}"]`) });
    state.running.node.querySelectorAll(".stats, .msg-actions, .legend").forEach((n) => n.remove());
    state.running.node.querySelector(".content").innerHTML = renderMarkdown(last.content);
  } else {
    state.running.node = addMessageNode({ role: "assistant", content: "" }, state.conv.messages.length);
    state.running.node.querySelector(".content").innerHTML = '<span class="typing"><i></i><i></i><i></i></span>';
  }
  state.running.node.classList.add("streaming");
  updateControls();
  scrollToBottom(true);
  return true;
}

async function sendTurn() {
  const text = el.input.value;
  if (!text.trim() || state.running || !state.ready) return;
  removeFailedTurn();
  state.conv.messages.push({ role: "user", content: text });
  if (state.conv.messages.length === 1 && !state.conv.isRenamed) state.conv.title = titleFrom(text);
  addMessageNode(state.conv.messages.at(-1), state.conv.messages.length - 1);
  if (!startTurn()) {
    state.conv.messages.pop();
    return renderConversation();
  }
  el.input.value = "";
  localStorage.removeItem(DRAFT_KEY);
  autosize();
  updateControls();
  await saveConversation();
}

const titleFrom = (text) => {
  const line = text.trim().split("\n")[0];
  return line.length > 48 ? `${line.slice(0, 47)}…` : line;
};

// keep: the server finished this turn (done), so the conversation keeps its reply.
function endTurn({ stats = null, note = null, error = null, keep }) {
  const turn = state.running;
  state.running = null;
  if (turn.continues) {
    endContinuation(turn, { stats, note, error, keep });
  } else if (error) {  // the message the turn answered is not kept: it goes back to the composer
    const failed = state.conv.messages.pop();
    el.messages.querySelector(`.msg[data-index="${state.conv.messages.length}"]`)?.classList.add("failed");
    if (!el.input.value) {
      el.input.value = failed.content;
      autosize();
    }
    turn.node.classList.remove("streaming");
    const line = Object.assign(document.createElement("div"), { className: "msg-error", textContent: error });
    turn.node.querySelector(".content").replaceChildren();
    turn.node.querySelector(".body").appendChild(line);
    announce(`Error: ${error}`);
  } else if (keep && turn.text) {
    const reply = { role: "assistant", content: turn.text, stats, note, tokens: turn.tokens };
    if (!stats) reply.numTokens = turn.numTokens;
    state.conv.messages.push(reply);
    turn.node.replaceWith(messageNode(reply, state.conv.messages.length - 1, methodLabel));
    announce("Reply finished.");
  } else {
    turn.node.remove();
  }
  markLastActions();
  saveConversation();
  updateControls();
  scrollToBottom(false);
  el.input.focus();
}

// A failed turn's nodes stay on screen until the next turn: they are past the conversation's end.
function removeFailedTurn() {
  el.messages.querySelectorAll(".msg").forEach((node) => {
    if (Number(node.dataset.index) >= state.conv.messages.length) node.remove();
  });
}

// A continuation's end: the reply grows by what came (if anything), with the new stats and note.
function endContinuation(turn, { stats, note, error, keep }) {
  const index = state.conv.messages.indexOf(turn.continues);
  if (keep && turn.text) {
    const reply = { ...turn.continues, content: turn.base + turn.text, tokens: turn.tokens, stats, note };
    if (!stats) reply.numTokens = turn.numTokens;
    state.conv.messages[index] = reply;
  }
  turn.node.replaceWith(messageNode(state.conv.messages[index], index, methodLabel));
  if (error) showError(error);
}

function continueReply() {
  if (state.running || !state.ready || state.conv.messages.at(-1)?.role !== "assistant") return;
  startTurn(true);
}

function stop() {
  if (state.running && send({ type: "cancel", id: state.running.id })) state.running.isCancelled = true;
}

// Drop the last reply and ask again.
function regenerate() {
  if (state.running || !state.ready || state.conv.messages.at(-1)?.role !== "assistant") return;
  removeFailedTurn();
  state.conv.messages.pop();
  el.messages.querySelector(`.msg[data-index="${state.conv.messages.length}"]`)?.remove();
  startTurn();
}

// Replace user message `index` and everything after it, then ask for a reply.
function resendEdited(index, text) {
  if (state.running || !state.ready || !text.trim()) return;
  state.conv.messages = [...state.conv.messages.slice(0, index), { role: "user", content: text }];
  renderConversation();
  startTurn();
  saveConversation();
}

async function saveConversation() {
  if (!state.conv.messages.length && !state.conv.system) return;
  state.conv.updated = Date.now();
  await store.putConversation(state.conv);
  store.setOpenId(state.conv.id);
  await sidebar.refresh(state.conv.id);
}

function openConversation(conv) {
  if (state.running) {
    send({ type: "cancel", id: state.running.id });
    state.running = null;
  }
  state.conv = conv;
  store.setOpenId(conv.id);
  el.system.value = conv.system;
  renderConversation();
  sidebar.refresh(conv.id);
  updateControls();
  closeSidebarIfOverlay();
  el.input.focus();
}

function newChat() {
  openConversation(store.newConversation());
  store.setOpenId(null);
  hideError();
}

// ---------------------------------------------------------------- rendering

function renderConversation() {
  el.messages.querySelectorAll(".msg").forEach((n) => n.remove());
  state.conv.messages.forEach((message, i) => el.messages.appendChild(messageNode(message, i, methodLabel)));
  el.empty.hidden = state.conv.messages.length > 0;
  markLastActions();
  scrollToBottom(true);
}

function addMessageNode(message, index) {
  el.empty.hidden = true;
  const node = messageNode(message, index, methodLabel);
  el.messages.appendChild(node);
  return node;
}

// Regenerate is offered on the last reply only, and Continue if that reply was cut off (it has a note).
function markLastActions() {
  const replies = el.messages.querySelectorAll(".msg.assistant");
  replies.forEach((node, i) => {
    const isLast = i === replies.length - 1 && !state.running;
    const regenerate = node.querySelector('[data-action="regenerate"]');
    const more = node.querySelector('[data-action="continue"]');
    if (regenerate) regenerate.hidden = !isLast;
    if (more) more.hidden = !isLast || !state.conv.messages[Number(node.dataset.index)]?.note;
  });
}

// Turn user message `node` into an editor; Enter (or Save) resends from there, Esc cancels.
function editMessage(node) {
  if (state.running || node.querySelector("textarea")) return;
  const index = Number(node.dataset.index);
  openEditor(node, state.conv.messages[index].content, {
    onSave: (text) => resendEdited(index, text),
    onCancel: () => { renderConversation(); el.input.focus(); },
  });
}

function queueRender(turn) {
  if (turn.renderQueued) return;
  turn.renderQueued = true;
  requestAnimationFrame(() => {
    turn.renderQueued = false;
    if (state.running !== turn) return;
    const stick = nearBottom();
    turn.node.querySelector(".content").innerHTML = renderMarkdown(turn.base + turn.text);
    if (stick) scrollToBottom(false);
  });
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

const announce = (text) => { el.announcer.textContent = text; };

function updateControls() {
  const running = Boolean(state.running);
  el.stop.hidden = !running;
  el.send.hidden = running;
  el.send.disabled = !state.ready || !el.input.value.trim();
  markLastActions();
}

function showSettings() {
  showFields(state.settings, state.defaults);
  el.speculation.checked = state.settings.speculation !== false;
  showMethods();
}

function readSettings() {
  state.settings = readFields({ ...state.settings, speculation: el.speculation.checked,
    spec_method: el.specMethod.value || state.settings.spec_method });
  saveSettings(state.settings);
  showMethods();
}

// The saved method if this server runs it, else the server's default (null: no speculation).
function chosenMethod() {
  const saved = state.settings.spec_method;
  return state.specMethods.includes(saved) ? saved : state.specMethods[0] || null;
}

const methodLabel = (name) => state.specLabels[name] || name;

// One option per method the server runs, named as the server names it.
function showMethods() {
  el.specMethod.replaceChildren(...state.specMethods.map((name) => {
    const label = methodLabel(name);
    return new Option(label.charAt(0).toUpperCase() + label.slice(1), name);
  }));
  el.specMethod.value = chosenMethod() || "";
  el.specMethod.disabled = state.specMethods.length < 2 || !el.speculation.checked;
}

// Speculation on/off and method, as this server can run them: sent with each turn.
function speculationParams() {
  if (el.speculation.disabled) return {};
  const params = { speculation: el.speculation.checked };
  if (chosenMethod()) params.spec_method = chosenMethod();
  return params;
}

function autosize() {
  el.input.style.height = "auto";
  el.input.style.height = `${Math.min(el.input.scrollHeight, 200)}px`;
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {  // no clipboard API off https/localhost
    const area = Object.assign(document.createElement("textarea"), { value: text });
    document.body.appendChild(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const label = button.textContent;
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = label; }, 1200);
}

function togglePanel(panel, toggle, open = panel.hidden) {
  panel.hidden = !open;
  toggle.setAttribute("aria-expanded", String(open));
}

const isSidebarOverlay = () => matchMedia("(max-width: 900px)").matches;
function closeSidebarIfOverlay() {
  if (isSidebarOverlay()) {
    el.sidebar.classList.remove("open");
    el.sidebarToggle.setAttribute("aria-expanded", "false");
  }
}

// ---------------------------------------------------------------- events

const sidebar = createSidebar({
  onOpen: openConversation,
  onDeleted: async (id) => { if (id === state.conv.id) newChat(); },
  onImported: (message, isError) => (isError ? showError(message) : announce(message)),
});

$("composer").addEventListener("submit", (e) => { e.preventDefault(); sendTurn(); });
el.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); sendTurn(); }
  if (e.key === "ArrowUp" && !el.input.value) {  // edit the last user message
    const last = [...el.messages.querySelectorAll(".msg.user")].at(-1);
    if (last) { e.preventDefault(); editMessage(last); }
  }
});
el.input.addEventListener("input", () => {
  autosize();
  updateControls();
  localStorage.setItem(DRAFT_KEY, el.input.value);
});
el.stop.addEventListener("click", stop);
el.newChat.addEventListener("click", newChat);
el.settingsToggle.addEventListener("click", () => togglePanel(el.settingsPanel, el.settingsToggle));
el.sidebarToggle.addEventListener("click", () => {
  const open = !el.sidebar.classList.contains("open");
  el.sidebar.classList.toggle("open", open);
  el.sidebarToggle.setAttribute("aria-expanded", String(open));
});
document.addEventListener("click", (e) => {
  if (!el.settingsPanel.hidden && !el.settingsPanel.contains(e.target) && !el.settingsToggle.contains(e.target)) {
    togglePanel(el.settingsPanel, el.settingsToggle, false);
  }
});
document.addEventListener("keydown", (e) => {
  const mod = e.ctrlKey || e.metaKey;
  if (e.key === "Escape" && state.running) { e.preventDefault(); stop(); }
  else if (e.key === "Escape" && !el.settingsPanel.hidden) {
    togglePanel(el.settingsPanel, el.settingsToggle, false);
    el.settingsToggle.focus();
  } else if (mod && e.shiftKey && e.key.toLowerCase() === "o") { e.preventDefault(); newChat(); }
  else if (mod && !e.shiftKey && e.key.toLowerCase() === "k") { e.preventDefault(); $("search").focus(); }
});
el.settingsPanel.addEventListener("change", readSettings);
el.system.addEventListener("change", () => {
  state.conv.system = el.system.value;
  saveConversation();
});
el.messages.addEventListener("click", (e) => {
  const button = e.target.closest("button");
  if (!button) return;
  const node = button.closest(".msg");
  if (button.classList.contains("copy")) copyText(button.closest(".code").querySelector("code").textContent, button);
  else if (button.dataset.action === "copy") copyText(state.conv.messages[Number(node.dataset.index)].content, button);
  else if (button.dataset.action === "regenerate") regenerate();
  else if (button.dataset.action === "continue") continueReply();
  else if (button.dataset.action === "edit") editMessage(node);
  else if (button.dataset.action === "spec-view") {
    const isOn = button.getAttribute("aria-pressed") !== "true";
    setSpecView(node, state.conv.messages[Number(node.dataset.index)], isOn);
  }
});
window.addEventListener("online", () => { if (!state.ready) connection.connect(); });

async function start() {
  buildFields($("sampling-fields"));
  showSettings();
  el.input.value = localStorage.getItem(DRAFT_KEY) || "";
  autosize();
  const saved = store.openId() && await store.getConversation(store.openId());
  if (saved) openConversation(saved);
  else await sidebar.refresh();
  updateControls();
  connection.connect();
  el.input.focus();
}

start();
