"""The chi-squared helper the distribution tests rely on, against textbook values."""

from __future__ import annotations

import pytest

from lab.harness import chi2_sf, uniformity_p_value


@pytest.mark.parametrize(
    ("x", "df", "p"),
    [
        (3.841, 1, 0.05),
        (6.635, 1, 0.01),
        (11.345, 3, 0.01),
        (20.0, 10, 0.0293),
        (0.5, 4, 0.9735),
        (9.0, 9, 0.4373),
    ],
)
def test_chi2_sf(x: float, df: int, p: float) -> None:
    assert chi2_sf(x, df) == pytest.approx(p, abs=5e-4)


def test_uniformity() -> None:
    assert uniformity_p_value([300, 300]) == pytest.approx(1.0)
    assert uniformity_p_value([350, 250]) < 0.01
    assert uniformity_p_value([205, 198, 197]) > 0.5
