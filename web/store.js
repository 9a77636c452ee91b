// Conversations kept in the browser: one IndexedDB object store, plain API (no wrapper library).
// A conversation: {id, title, created, updated, system, messages: [{role, content, ...}]}.

const DB_NAME = "chatserve";
const STORE = "conversations";
const OPEN_KEY = "chatserve.open";  // localStorage: the conversation shown, resumed after a reload

let dbPromise = null;

function db() {
  dbPromise ??= new Promise((resolve, reject) => {
    const request = indexedDB.open(DB_NAME, 1);
    request.onupgradeneeded = () => request.result.createObjectStore(STORE, { keyPath: "id" });
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
  return dbPromise;
}

// One request in its own transaction -> its result.
async function run(mode, makeRequest) {
  const tx = (await db()).transaction(STORE, mode);
  const request = makeRequest(tx.objectStore(STORE));
  return new Promise((resolve, reject) => {
    tx.oncomplete = () => resolve(request.result);
    tx.onerror = () => reject(tx.error);
  });
}

export const listConversations = async () =>
  (await run("readonly", (s) => s.getAll())).sort((a, b) => b.updated - a.updated);
export const getConversation = (id) => run("readonly", (s) => s.get(id));
export const putConversation = (conv) => run("readwrite", (s) => s.put(conv));
export const deleteConversation = (id) => run("readwrite", (s) => s.delete(id));

export function newConversation() {
  const now = Date.now();
  return { id: crypto.randomUUID(), title: "New chat", created: now, updated: now, system: "", messages: [] };
}

export const openId = () => localStorage.getItem(OPEN_KEY);
export const setOpenId = (id) => (id ? localStorage.setItem(OPEN_KEY, id) : localStorage.removeItem(OPEN_KEY));

// Export: every conversation in one JSON document. Import: the same shape (or one conversation, or
// a list of them); ids already here are replaced by the imported copy.
export async function exportJson() {
  return JSON.stringify({ format: "chatserve.conversations", version: 1, conversations: await listConversations() },
    null, 1);
}

export async function importJson(text) {
  const data = JSON.parse(text);
  const items = Array.isArray(data) ? data : data.conversations || [data];
  const valid = items.filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages));
  if (!valid.length) throw new Error("no conversations in this file");
  for (const conv of valid) {
    const messages = conv.messages.filter((m) => m && ["user", "assistant"].includes(m.role)
      && typeof m.content === "string");
    await putConversation({ ...newConversation(), ...conv, title: String(conv.title || "Imported chat"),
      system: String(conv.system || ""), messages });
  }
  return valid.length;
}
