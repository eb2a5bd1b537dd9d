def is_leap(year: int) -> bool:
    return year % 4 == 0 and year % 100 != 0
