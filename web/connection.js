// The websocket to the server: connect (with the API key if the page has one), reconnect with
// backoff after a close, and say why it closed (close codes in docs/protocol.md).

// Why the server closed the socket; all but 1008 retry.
const CLOSE_REASONS = {
  1001: { status: "Server shutting down", message: "The server is shutting down. This page reconnects when it is back." },
  1012: { status: "Server restarting", message: "The server is restarting. This page reconnects when it is back." },
  1013: { status: "Server busy", message: "The server has too many connections open. Retrying…" },
  4008: { status: "Fell behind", message: "This page fell too far behind the reply stream and was disconnected. Reconnecting…" },
};

function apiKey() {
  const fromUrl = new URLSearchParams(location.search).get("api_key");
  if (fromUrl) {  // keep it for reloads, but out of the address bar and the history
    sessionStorage.setItem("chatserve.api_key", fromUrl);
    history.replaceState(null, "", location.pathname);
  }
  return sessionStorage.getItem("chatserve.api_key");
}

// This tab's session key, kept across reloads: behind `chatserve serve --replicas N` it sends the
// tab's conversations (and its reconnects) to the replica holding their prefix (docs/scale-out.md).
function sessionKey() {
  let key = sessionStorage.getItem("chatserve.session");
  if (!key) {  // not crypto.randomUUID: that needs a secure context, and plain http on a LAN is not one
    key = Math.random().toString(36).slice(2) + Date.now().toString(36);
    sessionStorage.setItem("chatserve.session", key);
  }
  return key;
}

// onMessage(parsed message); onClosed(why: a CLOSE_REASONS entry or undefined);
// setStatus(kind, label) and showError(text) for the page's chrome.
export function createConnection({ onMessage, onClosed, setStatus, showError }) {
  let ws = null, retries = 0, retryTimer = null;

  function connect() {
    clearTimeout(retryTimer);
    setStatus("connecting", retries ? "Reconnecting…" : "Connecting…");
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(`${scheme}://${location.host}/ws?session=${encodeURIComponent(sessionKey())}`);
    ws = socket;
    socket.onopen = () => {
      const key = apiKey();
      if (key) send({ type: "auth", api_key: key });
    };
    socket.onmessage = (event) => {
      let message;
      try { message = JSON.parse(event.data); } catch { return showError("The server sent something unreadable."); }
      onMessage(message);
    };
    socket.onclose = (event) => onClose(socket, event);
  }

  function onClose(socket, event) {
    if (socket !== ws) return;
    const why = CLOSE_REASONS[event.code];
    onClosed(why);
    if (event.code === 1008) {  // refused (origin, API key): retrying would not help
      setStatus("offline", "Disconnected");
      return;
    }
    if (why) showError(why.message);
    const delay = Math.min(10000, 500 * 2 ** retries) * (0.8 + 0.4 * Math.random());
    retries += 1;
    const label = `${why ? `${why.status} · r` : "R"}econnecting in ${Math.ceil(delay / 1000)}s…`;
    setStatus("connecting", label);
    retryTimer = setTimeout(connect, delay);
  }

  function send(message) {
    if (!ws || ws.readyState !== WebSocket.OPEN) return false;
    ws.send(JSON.stringify(message));
    return true;
  }

  // The server said `ready`: the next loss starts the backoff afresh.
  const markReady = () => { retries = 0; };

  return { connect, send, markReady };
}
