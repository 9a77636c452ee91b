// Sampling settings: one input per websocket setting (docs/protocol.md). An empty input sends
// nothing, so the server's default applies; that default is shown as the placeholder.

const KEY = "chatserve.settings";

// key, label, and the input's bounds; `integer` parses as an integer, `lines` is one string per line.
const FIELDS = [
  { key: "temperature", label: "Temperature", min: 0, max: 2, step: 0.05 },
  { key: "top_p", label: "Top-p", min: 0, max: 1, step: 0.05 },
  { key: "top_k", label: "Top-k", min: 0, step: 1, integer: true },
  { key: "min_p", label: "Min-p", min: 0, max: 1, step: 0.01 },
  { key: "repetition_penalty", label: "Repetition penalty", min: 0, step: 0.05 },
  { key: "presence_penalty", label: "Presence penalty", min: -2, max: 2, step: 0.1 },
  { key: "frequency_penalty", label: "Frequency penalty", min: -2, max: 2, step: 0.1 },
  { key: "max_tokens", label: "Max tokens", min: 1, step: 1, integer: true },
  { key: "seed", label: "Seed", step: 1, integer: true },
  { key: "num_draft_tokens", label: "Draft tokens per step", min: 1, step: 1, integer: true },
  { key: "stop", label: "Stop strings, one per line", lines: true },
];

const inputId = (key) => `set-${key.replaceAll("_", "-")}`;

// The saved choices: {key: value} for the fields the user set, plus speculation and spec_method.
export function loadSettings() {
  try {
    return JSON.parse(localStorage.getItem(KEY) || "{}");
  } catch {
    return {};
  }
}

export function saveSettings(settings) {
  localStorage.setItem(KEY, JSON.stringify(settings));
}

export function buildFields(container) {
  container.replaceChildren(...FIELDS.map((f) => {
    const label = document.createElement("label");
    label.className = "field";
    const name = Object.assign(document.createElement("span"), { className: "name", textContent: f.label });
    const input = document.createElement(f.lines ? "textarea" : "input");
    Object.assign(input, { id: inputId(f.key) });
    input.dataset.testid = inputId(f.key);
    input.dataset.key = f.key;
    if (f.lines) input.rows = 2;
    else {
      input.type = "number";
      for (const bound of ["min", "max", "step"]) if (f[bound] != null) input[bound] = f[bound];
    }
    label.append(name, input);
    return label;
  }));
}

// Show the saved values, and the server's defaults (ready.defaults) as placeholders.
export function showFields(settings, defaults) {
  for (const f of FIELDS) {
    const input = document.getElementById(inputId(f.key));
    const saved = settings[f.key];
    input.value = saved == null ? "" : f.lines ? saved.join("\n") : saved;
    const def = defaults[f.key];
    const shown = def == null || (Array.isArray(def) && !def.length) ? "none" : Array.isArray(def) ? def.join(", ") : def;
    input.placeholder = `default: ${shown}`;
  }
}

// The inputs -> settings: unset fields are left out (the server's default applies).
export function readFields(settings) {
  const out = { speculation: settings.speculation, spec_method: settings.spec_method };
  for (const f of FIELDS) {
    const raw = document.getElementById(inputId(f.key)).value;
    if (f.lines) {
      const lines = raw.split("\n").filter((line) => line !== "");
      if (lines.length) out[f.key] = lines;
    } else if (raw.trim() !== "" && Number.isFinite(Number(raw))) {
      out[f.key] = f.integer ? Math.trunc(Number(raw)) : Number(raw);
    }
  }
  return out;
}

// The sampling part of a chat turn's `params`.
export function samplingParams(settings, maxTokensLimit) {
  const params = {};
  for (const f of FIELDS) if (settings[f.key] != null) params[f.key] = settings[f.key];
  if (params.max_tokens != null) params.max_tokens = Math.min(params.max_tokens, maxTokensLimit);
  return params;
}
