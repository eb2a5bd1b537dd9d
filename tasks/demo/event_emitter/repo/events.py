class EventEmitter:
    def on(self, event, listener=None):
        raise NotImplementedError

    def once(self, event, listener):
        raise NotImplementedError

    def off(self, event, listener) -> None:
        raise NotImplementedError

    def emit(self, event, *args, **kwargs) -> int:
        raise NotImplementedError

    def listener_count(self, event) -> int:
        raise NotImplementedError
