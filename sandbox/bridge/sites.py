"""Call sites, read from bytecode: where a method loaded by ``obj.name`` is called as a
statement (its result discarded), outside any try/except/with of the same function.

One job, for deferral (deferral.py): ``call_of_load`` answers, at the moment a solution
method is loaded (``proxy.name``), whether that load instruction feeds a discarded call
and at which offset that call is, so the call itself only compares two numbers.
Facts are computed once per code object and cached (the code object is kept with its
entries, so its id is never reused while they stand).
"""

from __future__ import annotations

import sys



def can_defer() -> bool:
    """Deferral needs the exception table and source positions of CPython 3.11+ bytecode."""
    if sys.version_info < (3, 11):
        return False
    import dis

    return hasattr(dis, "_parse_exception_table")


def code_facts(code) -> tuple:
    """({offset of a CALL whose result is discarded: {method name: offset of the load of
    that name at the call's own source position}}, [(start, end) of every handled range])."""
    import dis  # the tests' side only, on the first deferrable call (~7 ms to import)

    discarded: dict = {}
    try:
        instrs = list(dis.get_instructions(code))
        handled = [(e.start, e.end) for e in dis._parse_exception_table(code)]
    except Exception:  # noqa: BLE001 - bytecode this interpreter cannot read: never defer
        return {}, [(0, sys.maxsize)]
    loads: dict = {}
    for i, ins in enumerate(instrs):
        pos = ins.positions
        if pos is None or pos.lineno is None or pos.col_offset is None:
            continue
        start = (pos.lineno, pos.col_offset)
        if ins.opname in ("LOAD_METHOD", "LOAD_ATTR") and type(ins.argval) is str:
            loads.setdefault(start, {})[ins.argval] = ins.offset
        elif ins.opname == "CALL" and i + 1 < len(instrs) and instrs[i + 1].opname == "POP_TOP" and start in loads:
            discarded[ins.offset] = dict(loads[start])
    return discarded, handled


_FACTS: dict = {}  # id(code) -> (code, facts)
_LOADS: dict = {}  # (id(code), load offset, name) -> (code, call offset or -1)
_HANDLED: dict = {}  # (id(code), offset) -> (code, in a handled range)


def facts(code) -> tuple:
    known = _FACTS.get(id(code))
    if known is None or known[0] is not code:
        known = _FACTS[id(code)] = (code, code_facts(code))
    return known[1]


def handled(code, lasti: int) -> bool:
    """Whether the instruction at ``lasti`` is covered by a try/except/with of its function."""
    key = (id(code), lasti)
    known = _HANDLED.get(key)
    if known is None or known[0] is not code:
        known = _HANDLED[key] = (code, any(start <= lasti < end for start, end in facts(code)[1]))
    return known[1]


def call_of_load(code, lasti: int, name: str) -> int:
    """The offset of the discarded, unhandled call that the load of ``name`` at ``lasti``
    feeds, or -1."""
    key = (id(code), lasti, name)
    known = _LOADS.get(key)
    if known is None or known[0] is not code:
        call = -1
        for offset, names in facts(code)[0].items():
            if names.get(name) == lasti and not handled(code, offset):
                if call != -1:  # two calls claim one load: none is deferred
                    call = -1
                    break
                call = offset
        known = _LOADS[key] = (code, call)
    return known[1]


def line_of(code, offset: int):
    import dis

    for ins in dis.get_instructions(code):
        if ins.offset == offset and ins.positions is not None:
            return ins.positions.lineno
    return None
