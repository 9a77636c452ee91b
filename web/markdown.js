// Reply text -> safe HTML: markdown-it (raw HTML off), highlight.js for fenced code, DOMPurify last.
// The libraries are classic scripts loaded before this module (web/vendor/README.md).

const { markdownit, DOMPurify, hljs } = window;

const md = markdownit({ html: false, linkify: true, breaks: false });

const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) =>
  ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);

// A fenced block: a head with its language and a copy button, then the highlighted code.
md.renderer.rules.fence = (tokens, idx) => {
  const token = tokens[idx];
  const lang = token.info.trim().split(/\s+/)[0].toLowerCase();
  const known = lang && hljs.getLanguage(lang);
  const code = known ? hljs.highlight(token.content, { language: lang, ignoreIllegals: true }).value
    : escapeHtml(token.content);
  return `<div class="code"><div class="code-head"><span>${escapeHtml(lang || "code")}</span>` +
    `<button type="button" class="copy" aria-label="Copy code">Copy</button></div>` +
    `<pre><code class="hljs${known ? ` language-${escapeHtml(lang)}` : ""}">${code}</code></pre></div>`;
};

// Links open in a new tab and tell the target nothing; DOMPurify has already dropped javascript: URLs.
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

export function renderMarkdown(text) {
  return DOMPurify.sanitize(md.render(text), { ADD_ATTR: ["target"] });
}
