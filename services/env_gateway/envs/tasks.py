"""Number puzzles for the python environment: easy to state, tedious by hand, a few lines of code.
Each reference answer is computed here, in well under a millisecond per task."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Task:
    id: str
    question: str
    answer: int


def _primes_below(n: int) -> list[int]:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = bytearray(len(range(i * i, n, i)))
    return [i for i in range(n) if sieve[i]]


def _num_divisors(n: int) -> int:
    count, i = 0, 1
    while i * i <= n:
        if n % i == 0:
            count += 1 if i * i == n else 2
        i += 1
    return count


def _fib_mod(n: int, m: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, (a + b) % m
    return a


def _collatz_steps(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def _sum_primes(rng: random.Random, scale: int) -> Task:
    n = rng.randint(1000, 10_000 * scale)
    return Task(id=f"sum-primes-{n}", question=f"What is the sum of all prime numbers below {n}?",
                answer=sum(_primes_below(n)))


def _divisors(rng: random.Random, scale: int) -> Task:
    n = rng.randint(10_000, 10 ** (5 + scale))
    return Task(id=f"divisors-{n}", question=f"How many positive divisors does {n} have?", answer=_num_divisors(n))


def _fibonacci(rng: random.Random, scale: int) -> Task:
    n = rng.randint(100, 5000 * scale)
    return Task(id=f"fib-{n}", question=f"What is the {n}-th Fibonacci number (F(0)=0, F(1)=1) modulo 1000000007?",
                answer=_fib_mod(n, 1_000_000_007))


def _digit_sum(rng: random.Random, scale: int) -> Task:
    k = rng.randint(100, 1000 * scale)
    return Task(id=f"digits-2^{k}", question=f"What is the sum of the decimal digits of 2**{k}?",
                answer=sum(int(d) for d in str(2**k)))


def _divisible(rng: random.Random, scale: int) -> Task:
    n, a, b = rng.randint(1000, 10 ** (5 + scale)), rng.randint(3, 30), rng.randint(3, 30)
    answer = n // a + n // b - n // (a * b // _gcd(a, b))
    return Task(id=f"divisible-{n}-{a}-{b}", answer=answer,
                question=f"How many integers from 1 to {n} (inclusive) are divisible by {a} or by {b}?")


def _collatz(rng: random.Random, scale: int) -> Task:
    n = rng.randint(1000, 10 ** (4 + scale))
    return Task(id=f"collatz-{n}", answer=_collatz_steps(n),
                question=f"Starting from {n}, how many steps of the Collatz map (n/2 if n is even, else 3n+1) "
                         "does it take to reach 1?")


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


FAMILIES: tuple[Callable[[random.Random, int], Task], ...] = (
    _sum_primes, _divisors, _fibonacci, _digit_sum, _divisible, _collatz)


def make_task(rng: random.Random, difficulty: int) -> Task:
    return rng.choice(FAMILIES)(rng, difficulty)
