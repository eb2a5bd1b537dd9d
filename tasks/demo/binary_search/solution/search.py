def find(sorted_items: list, target) -> int:
    lo, hi = 0, len(sorted_items)
    # invariant: items before lo are < target, items at or after hi are >= target
    while lo < hi:
        mid = (lo + hi) // 2
        if sorted_items[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    if lo < len(sorted_items) and sorted_items[lo] == target:
        return lo
    return -1
