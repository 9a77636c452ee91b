// The conversation list: search, open, rename, delete, export and import. Storage is store.js;
// what "open" means is the caller's (chat.js passes callbacks).

import * as store from "./store.js";

const $ = (id) => document.getElementById(id);

export function createSidebar({ onOpen, onDeleted, onImported }) {
  const list = $("conversations"), search = $("search");
  let currentId = null;

  async function refresh(openId = currentId) {
    currentId = openId;
    const query = search.value.trim().toLowerCase();
    const convs = (await store.listConversations()).filter((c) => !query || matches(c, query));
    list.replaceChildren(...convs.map(item));
    if (!convs.length) {
      const empty = Object.assign(document.createElement("li"), { className: "none",
        textContent: query ? "No chat matches." : "No saved chats yet." });
      list.appendChild(empty);
    }
  }

  const matches = (conv, query) => conv.title.toLowerCase().includes(query)
    || conv.messages.some((m) => m.content.toLowerCase().includes(query));

  function item(conv) {
    const li = document.createElement("li");
    li.className = "conv";
    li.dataset.id = conv.id;
    li.dataset.testid = "conversation";
    const open = Object.assign(document.createElement("button"), { type: "button", className: "conv-open",
      textContent: conv.title });
    if (conv.id === currentId) open.setAttribute("aria-current", "true");
    const rename = iconButton("rename", `Rename “${conv.title}”`, "M4 20h4L19 9l-4-4L4 16z");
    const remove = iconButton("delete", `Delete “${conv.title}”`, "M5 7h14M10 7V4h4v3M7 7l1 13h8l1-13");
    li.append(open, rename, remove);
    return li;
  }

  function iconButton(action, label, path) {
    const button = Object.assign(document.createElement("button"), { type: "button", className: `icon ${action}` });
    button.dataset.action = action;
    button.setAttribute("aria-label", label);
    button.title = label;
    button.innerHTML = `<svg viewBox="0 0 24 24" aria-hidden="true"><path d="${path}"/></svg>`;
    return button;
  }

  list.addEventListener("click", async (e) => {
    const li = e.target.closest("li.conv");
    if (!li) return;
    const action = e.target.closest("button")?.dataset.action;
    const conv = await store.getConversation(li.dataset.id);
    if (action === "rename") {
      const title = prompt("Rename this chat", conv.title);
      if (title && title.trim()) {
        await store.putConversation({ ...conv, title: title.trim(), isRenamed: true });
        await refresh();
      }
    } else if (action === "delete") {
      if (!confirm(`Delete “${conv.title}”?`)) return;
      await store.deleteConversation(conv.id);
      await onDeleted(conv.id);
      await refresh();
    } else {
      onOpen(conv);
    }
  });

  search.addEventListener("input", () => refresh());

  $("export").addEventListener("click", async () => {
    const blob = new Blob([await store.exportJson()], { type: "application/json" });
    const link = Object.assign(document.createElement("a"), { href: URL.createObjectURL(blob),
      download: `chatserve-chats-${new Date().toISOString().slice(0, 10)}.json` });
    link.click();
    URL.revokeObjectURL(link.href);
  });
  $("import").addEventListener("click", () => $("import-file").click());
  $("import-file").addEventListener("change", async (e) => {
    const file = e.target.files[0];
    e.target.value = "";
    if (!file) return;
    try {
      const count = await store.importJson(await file.text());
      await refresh();
      onImported(`Imported ${count} chat${count === 1 ? "" : "s"}.`);
    } catch (error) {
      onImported(`Import failed: ${error.message}`, true);
    }
  });

  return { refresh };
}
