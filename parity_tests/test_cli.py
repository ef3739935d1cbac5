"""The command lines of the tools and benchmarks: what a newcomer runs first."""

import pytest

from leapquant.tools.demo import rate_text


def test_demo_rate_keeps_its_digits_below_one_token_a_second():
    """A slow backend (the Triton interpreter) decodes under a token a second: its rate must not print as 0."""
    assert rate_text(0.4213) == "0.421"
    assert rate_text(0.004) == "0.004"
    assert rate_text(29.17) == "29.2"
    assert rate_text(12345.6) == "12,346"
    assert rate_text(float("nan")) == "n/a"
    assert all(rate_text(r) not in ("0", "0.0") for r in (0.3, 0.05, 0.0012))
