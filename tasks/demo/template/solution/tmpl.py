import re

FILTERS = {"upper": str.upper, "lower": str.lower, "title": str.title, "strip": str.strip}
_PART = re.compile(r"\{\{\{\{|\}\}\}\}|\{\{(.*?)\}\}|\{\{", re.DOTALL)


def _lookup(context: dict, dotted: str):
    value = context
    for part in dotted.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif not isinstance(value, dict) and hasattr(value, part):
            value = getattr(value, part)
        else:
            raise KeyError(dotted)
    return value


def _expand(expression: str, context: dict) -> str:
    name, *filters = [p.strip() for p in expression.split("|")]
    if not name:
        raise ValueError("empty placeholder")
    text = str(_lookup(context, name))
    for f in filters:
        if f not in FILTERS:
            raise ValueError(f"unknown filter {f!r}")
        text = FILTERS[f](text)
    return text


def render(template: str, context: dict) -> str:
    out, pos = [], 0
    for match in _PART.finditer(template):
        out.append(template[pos:match.start()])
        token = match.group(0)
        if token == "{{{{":
            out.append("{{")
        elif token == "}}}}":
            out.append("}}")
        elif match.group(1) is None:
            raise ValueError(f"unclosed '{{{{' at position {match.start()}")
        else:
            out.append(_expand(match.group(1), context))
        pos = match.end()
    out.append(template[pos:])
    return "".join(out)
