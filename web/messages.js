// One message as a DOM node: a user bubble (text as typed, never parsed) or a reply (markdown) with
// its stats, actions and speculation view; and the editor that replaces a user bubble.

import { renderMarkdown } from "./markdown.js";

export function messageNode(message, index, methodLabel) {
  const node = document.createElement("div");
  node.className = `msg ${message.role}`;
  node.dataset.testid = `msg-${message.role}`;
  node.dataset.index = index;
  if (message.role === "user") {
    node.innerHTML = '<div class="bubble"></div><div class="msg-actions">' +
      '<button type="button" data-action="edit" aria-label="Edit and resend">Edit</button></div>';
    node.querySelector(".bubble").textContent = message.content;  // user text is shown as typed, never parsed
    return node;
  }
  node.innerHTML = '<div class="avatar" aria-hidden="true"></div><div class="body"><div class="content"></div></div>';
  if (!message.content) return node;
  node.querySelector(".content").innerHTML = renderMarkdown(message.content);
  const body = node.querySelector(".body");
  if (message.stats || message.note || message.numTokens) body.appendChild(statsLine(message, methodLabel));
  const actions = document.createElement("div");
  actions.className = "msg-actions";
  actions.innerHTML = '<button type="button" data-action="copy" aria-label="Copy reply">Copy</button>' +
    '<button type="button" data-action="regenerate" aria-label="Regenerate reply" hidden>Regenerate</button>' +
    '<button type="button" data-action="continue" aria-label="Continue this reply" hidden>Continue</button>';
  body.appendChild(actions);
  return node;
}

function statsLine({ stats, note, tokens, numTokens }, methodLabel) {
  const line = document.createElement("div");
  line.className = "stats";
  line.dataset.testid = "stats";
  const add = (text, cls) => line.appendChild(Object.assign(document.createElement("span"), { textContent: text,
    className: cls || "" }));
  if (stats && stats.ttft_ms != null) add(`TTFT ${Math.round(stats.ttft_ms)} ms`);
  if (stats && stats.tpot_ms) add(`${(1000 / stats.tpot_ms).toFixed(1)} tok/s`);
  if (stats && stats.spec_method) add(methodLabel(stats.spec_method));
  if (stats && stats.acceptance_rate != null) add(`${Math.round(100 * stats.acceptance_rate)}% accepted`);
  if (stats && stats.mean_accepted_length) add(`${stats.mean_accepted_length.toFixed(2)} tok/step`);
  add(`${stats ? stats.generated_tokens : numTokens} tokens`);
  if (stats && stats.cached_tokens) add(`${stats.cached_tokens} cached`);
  if (note) add(note, "tag");
  if (tokens && tokens.length) {
    const toggle = Object.assign(document.createElement("button"), { type: "button", className: "spec-link",
      textContent: "Speculation view" });
    toggle.dataset.action = "spec-view";
    toggle.setAttribute("aria-pressed", "false");
    line.appendChild(toggle);
  }
  return line;
}

// The speculation view of reply `node` on or off: its tokens tinted by origin, with a legend that counts them.
export function setSpecView(node, message, isOn) {
  const content = node.querySelector(".content");
  node.querySelector(".spec-link").setAttribute("aria-pressed", String(isOn));
  node.classList.toggle("spec-view", isOn);
  node.querySelector(".legend")?.remove();
  if (!isOn) {
    content.innerHTML = renderMarkdown(message.content);
    return;
  }
  content.replaceChildren(renderTokens(message.tokens));
  const counts = originCounts(message.tokens);
  const legend = document.createElement("div");
  legend.className = "legend";
  legend.dataset.testid = "legend";
  for (const [origin, label] of Object.entries(ORIGINS)) {
    if (!counts[origin]) continue;
    legend.appendChild(Object.assign(document.createElement("span"), { className: `tok ${origin}`,
      textContent: `${label}: ${counts[origin]}` }));
  }
  content.before(legend);
}

// The speculation view: each token as a span tinted by how it came ([text, origin] pairs).
function renderTokens(tokens) {
  const box = document.createElement("div");
  box.className = "tokens";
  for (const [text, origin] of tokens) {
    const span = document.createElement("span");
    span.className = `tok ${origin}`;
    span.textContent = text;
    box.appendChild(span);
  }
  return box;
}

const ORIGINS = {
  accepted: "accepted draft",
  recovered: "recovered (target, after a rejected draft)",
  bonus: "bonus (target, after every draft was accepted)",
  target: "target (no draft)",
};

function originCounts(tokens) {
  const counts = Object.fromEntries(Object.keys(ORIGINS).map((k) => [k, 0]));
  for (const [, origin] of tokens) counts[origin] = (counts[origin] || 0) + 1;
  return counts;
}

// Replace user message `node`'s bubble by an editor of `text`: Enter or Save calls onSave(new text),
// Esc or Cancel calls onCancel.
export function openEditor(node, text, { onSave, onCancel }) {
  const bubble = node.querySelector(".bubble");
  const editor = Object.assign(document.createElement("textarea"), { className: "editor", value: text, rows: 3 });
  editor.setAttribute("aria-label", "Edit message");
  const save = Object.assign(document.createElement("button"), { type: "button", className: "save",
    textContent: "Save & send" });
  const cancel = Object.assign(document.createElement("button"), { type: "button", textContent: "Cancel" });
  const form = document.createElement("div");
  form.className = "edit";
  form.append(editor, save, cancel);
  bubble.replaceWith(form);
  node.querySelector(".msg-actions").hidden = true;
  save.addEventListener("click", () => onSave(editor.value));
  cancel.addEventListener("click", onCancel);
  editor.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); onSave(editor.value); }
    if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); onCancel(); }
  });
  editor.focus();
}
