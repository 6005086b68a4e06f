"""benchmarks/adaptive/step_signal.py's measures: the AUC and the probe's fit, on data whose answer
is known (a signal that separates the classes, its reverse, and noise)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.bench.conftest import load_benchmark


@pytest.fixture(scope="module")
def signal():
    return load_benchmark("adaptive/step_signal.py")


def test_auc_reads_separation_reversal_and_noise(signal):
    rng = np.random.default_rng(0)
    label = rng.random(4000) < 0.7
    assert signal.auc(label + 0.01 * rng.random(4000), label) == pytest.approx(1.0)
    assert signal.auc(-(label + 0.01 * rng.random(4000)), label) == pytest.approx(0.0)
    assert abs(signal.auc(rng.random(4000), label) - 0.5) < 0.03
    # a known effect size: positives shifted by one standard deviation -> AUC = Phi(1 / sqrt 2) = 0.760
    score = rng.standard_normal(4000) + label
    assert signal.auc(score, label) == pytest.approx(0.760, abs=0.02)


def test_the_probe_finds_a_planted_direction_and_not_noise(signal):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3000, 20))
    label = (x[:, 3] - 0.5 * x[:, 7] + 0.3 * rng.standard_normal(3000)) > 0
    z = np.hstack([x, np.ones((3000, 1))])
    w = signal.fit_logistic(z[:1500], label[:1500].astype(float), ridge=1.0)
    assert signal.auc(z[1500:] @ w, label[1500:]) > 0.95
    noise = rng.random(3000) < 0.5  # labels unrelated to x: held-out AUC near 0.5
    w = signal.fit_logistic(z[:1500], noise[:1500].astype(float), ridge=1.0)
    assert abs(signal.auc(z[1500:] @ w, noise[1500:]) - 0.5) < 0.05
