"""Every replica's Prometheus page as one page: each sample gains a `replica` label, and each
metric family is written once (two pages concatenated would repeat `# TYPE` lines, which
Prometheus refuses). Pure text in, text out; no Ray.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"


def merge_replica_metrics(pages: dict[str, str]) -> str:
    """`pages`: replica id -> that replica's /metrics text. Families keep their first page's help
    and type; samples keep their order within a page, pages follow in the dict's order."""
    families: dict[str, tuple[str, str, list[str]]] = {}  # name -> (help, type, sample lines)
    for replica, text in pages.items():
        for family in text_string_to_metric_families(text):
            _, _, lines = families.setdefault(family.name, (family.documentation, family.type, []))
            for sample in family.samples:
                labels = {**sample.labels, REPLICA_LABEL: replica}
                lines.append(f"{sample.name}{{{_labels(labels)}}} {_number(sample.value)}")
    out = []
    for name, (doc, kind, lines) in families.items():
        name = f"{name}_total" if kind == "counter" else name  # as prometheus_client writes it
        out += [f"# HELP {name} {_escape_help(doc)}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n" if out else ""


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{_escape_value(v)}"' for k, v in labels.items())


def _escape_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(doc: str) -> str:
    return doc.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
