class _Registration:
    __slots__ = ("listener", "once", "fired")

    def __init__(self, listener, once: bool) -> None:
        self.listener = listener
        self.once = once
        self.fired = False


class EventEmitter:
    def __init__(self) -> None:
        self._listeners: dict = {}

    def on(self, event, listener=None):
        if listener is None:
            return lambda fn: self.on(event, fn)
        self._listeners.setdefault(event, []).append(_Registration(listener, once=False))
        return listener

    def once(self, event, listener):
        self._listeners.setdefault(event, []).append(_Registration(listener, once=True))
        return listener

    def off(self, event, listener) -> None:
        regs = self._listeners.get(event, [])
        for i, reg in enumerate(regs):
            if reg.listener == listener:
                del regs[i]
                return

    def emit(self, event, *args, **kwargs) -> int:
        called = 0
        for reg in list(self._listeners.get(event, [])):
            if reg.once:
                # removed before the call, so a nested emit cannot fire it a second time
                if reg.fired:
                    continue
                reg.fired = True
                regs = self._listeners.get(event, [])
                if reg in regs:
                    regs.remove(reg)
            reg.listener(*args, **kwargs)
            called += 1
        return called

    def listener_count(self, event) -> int:
        return len(self._listeners.get(event, []))
