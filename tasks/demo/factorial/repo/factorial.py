def factorial(n: int) -> int:
    if n < 0:
        raise ValueError("factorial of a negative number")
    result = 1
    for i in range(1, n):
        result *= i
    return result
