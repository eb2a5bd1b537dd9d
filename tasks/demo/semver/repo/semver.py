class Version:
    @classmethod
    def parse(cls, text: str) -> "Version":
        raise NotImplementedError
