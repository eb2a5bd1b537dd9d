def flatten(items: list) -> list:
    out: list = []
    # An explicit stack instead of recursion: deep nesting must not hit the recursion limit.
    stack = [iter(items)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out
