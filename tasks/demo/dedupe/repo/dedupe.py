def unique(items, key=None):
    return list(set(items))
