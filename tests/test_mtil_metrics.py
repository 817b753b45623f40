"""ZSCL's MTIL Transfer / Avg. / Last and the class-incremental Avg / Last (iCaRL protocol).

Reproduces ZSCL's released order-I numbers and MoE-Adapters' released class-incremental logs, plus hand-computed
3 x 3 cases with NaN cells and T = 1.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hf_ccl.evaluation import continual_metrics as cm

# ZSCL on MTIL order I, github.com/Thunderbeee/ZSCL at b96e714, `mtil/results/t3_7.npy` (notebook
# `mtil/results.ipynb` cell 12, "# ZSCL", `visualize("./t3_7.npy")`). The file holds 11 x 12 accuracies (%): row i =
# the checkpoint after training dataset i, columns Aircraft, Caltech101, CIFAR10, CIFAR100, DTD, EuroSAT, Flowers,
# Food, MNIST, OxfordPet, StanfordCars, SUN397. As in the notebook's `statistics(arr)`, the CIFAR10 column (index 2,
# not an MTIL dataset) is dropped; values rounded here to 6 decimals. There is no zero-shot row.
# fmt: off
ZSCL_ORDER_I = [
    [55.115512, 86.002304, 66.330000, 44.893617, 49.240741, 70.564319, 88.336634, 53.580000, 87.380758, 61.298346, 65.679739],
    [48.874887, 94.182028, 68.550000, 44.680851, 50.444444, 66.970239, 87.631683, 55.190000, 85.009539, 61.012312, 65.937198],
    [47.134713, 93.145161, 86.200000, 46.489362, 50.129630, 68.840462, 87.702970, 63.430000, 87.598801, 60.564606, 67.445175],
    [47.014701, 93.836406, 84.990000, 76.170213, 51.740741, 69.946333, 87.774257, 65.870000, 88.389207, 61.211292, 67.150936],
    [46.144614, 92.799539, 83.970000, 75.000000, 97.759259, 69.084404, 87.148515, 67.560000, 87.980376, 60.303445, 67.086571],
    [43.774377, 92.511521, 83.210000, 73.457447, 97.240741, 96.340868, 87.104950, 63.300000, 86.481330, 58.835966, 66.852099],
    [44.344434, 92.223502, 82.890000, 71.223404, 96.777778, 93.755082, 92.201980, 63.470000, 87.271736, 60.266136, 67.914119],
    [41.944194, 91.935484, 80.480000, 67.819149, 95.296296, 89.510490, 91.857426, 99.010000, 84.382666, 58.400696, 66.470507],
    [41.614161, 91.820276, 81.320000, 68.191489, 95.666667, 90.730200, 91.984158, 98.840000, 95.284819, 58.873274, 66.429130],
    [39.783978, 91.877880, 81.820000, 68.882979, 95.703704, 91.624654, 91.841584, 98.760000, 94.467157, 85.847531, 67.325640],
    [40.624062, 92.165899, 81.290000, 70.531915, 94.759259, 90.486258, 91.885149, 98.710000, 93.867539, 85.300336, 80.221599],
]
# fmt: on
# The notebook's printed output of cell 12 (`np.around(..., decimals=1)`) = ZSCL paper Tab. 3, row "ZSCL".
ZSCL_TRANSFER = [86.0, 67.4, 45.4, 50.4, 69.1, 87.6, 61.8, 86.8, 60.1, 66.8]
ZSCL_AVG = [45.1, 92.0, 80.1, 64.3, 79.5, 81.6, 89.6, 75.2, 88.9, 64.7, 68.0]
ZSCL_LAST = [40.6, 92.2, 81.3, 70.5, 94.8, 90.5, 91.9, 98.7, 93.9, 85.3, 80.2]

# ZSCL notebook cell 5, "# Zero-shot": the initial CLIP's scores (CIFAR10 = 0.0 dropped), repeated on all 11 rows.
ZERO_SHOT = [24.3, 88.4, 68.2, 44.6, 54.9, 71.0, 88.5, 59.4, 89.0, 64.7, 65.2]


def test_zscl_order_i_reproduces_released_numbers() -> None:
    assert round(cm.mtil_transfer(ZSCL_ORDER_I), 1) == 68.1
    assert round(cm.mtil_average(ZSCL_ORDER_I), 1) == 75.4
    assert round(cm.mtil_last(ZSCL_ORDER_I), 1) == 83.6
    # Unrounded values from the full-precision .npy.
    assert cm.mtil_transfer(ZSCL_ORDER_I) == pytest.approx(68.138092, abs=1e-5)
    assert cm.mtil_average(ZSCL_ORDER_I) == pytest.approx(75.385145, abs=1e-5)
    assert cm.mtil_last(ZSCL_ORDER_I) == pytest.approx(83.622001, abs=1e-5)


def test_zscl_order_i_per_dataset_rows() -> None:
    per_task = cm.mtil_per_task(ZSCL_ORDER_I)
    assert math.isnan(per_task["transfer"][0])
    assert np.round(per_task["transfer"][1:], 1).tolist() == ZSCL_TRANSFER
    assert np.round(per_task["average"], 1).tolist() == ZSCL_AVG
    assert np.round(per_task["last"], 1).tolist() == ZSCL_LAST


def test_zscl_zero_shot_reference_row() -> None:
    # ZSCL Tab. 3 "Zero-shot": Transfer 69.4, Avg. 65.3, Last 65.3 (notebook cell 5 output).
    tiled = np.tile(ZERO_SHOT, (11, 1))
    assert round(cm.mtil_transfer(tiled), 1) == 69.4
    assert round(cm.mtil_average(tiled), 1) == 65.3
    assert round(cm.mtil_last(tiled), 1) == 65.3


def test_raw_eleven_by_twelve_matrix_is_rejected() -> None:
    # The released .npy has the extra CIFAR10 column; it must be dropped before calling the metrics.
    with pytest.raises(ValueError):
        cm.mtil_transfer(np.zeros((11, 12)))


# Hand-computed 3 x 3 (same matrix as tests/test_continual_metrics.py):
R = [
    [50.0, 10.0, 20.0],
    [55.0, 60.0, 30.0],
    [30.0, 45.0, 69.0],
]
# transfer per task: [NaN, R[0,1] = 10, (R[0,2] + R[1,2]) / 2 = (20 + 30) / 2 = 25]  -> Transfer = (10 + 25) / 2 = 17.5
#   (the flat mean of the strict upper triangle, tic_forward, is (10 + 20 + 30) / 3 = 20: columns weigh equally here)
# average per task: [(50 + 55 + 30) / 3 = 45, (10 + 60 + 45) / 3 = 115/3, (20 + 30 + 69) / 3 = 119/3]
#   -> Avg = (135 + 115 + 119) / 9 = 369 / 9 = 41
# last per task: [30, 45, 69] -> Last = 144 / 3 = 48
PER_TASK_TRANSFER = [math.nan, 10.0, 25.0]
PER_TASK_AVERAGE = [45.0, 115 / 3, 119 / 3]
PER_TASK_LAST = [30.0, 45.0, 69.0]


def test_mtil_hand_computed() -> None:
    assert cm.mtil_transfer(R) == pytest.approx(17.5)
    assert cm.mtil_average(R) == pytest.approx(41.0)
    assert cm.mtil_last(R) == pytest.approx(48.0)
    assert cm.mtil_last(R) == cm.final_average(R)
    assert cm.tic_forward(R) == pytest.approx(20.0)
    per_task = cm.mtil_per_task(np.array(R))
    assert set(per_task) == {"transfer", "average", "last"}
    np.testing.assert_allclose(per_task["transfer"], PER_TASK_TRANSFER)  # NaN == NaN here
    np.testing.assert_allclose(per_task["average"], PER_TASK_AVERAGE)
    np.testing.assert_allclose(per_task["last"], PER_TASK_LAST)
    assert all(v.shape == (3,) for v in per_task.values())


def test_mtil_nan_propagation() -> None:
    upper = np.array(R)
    upper[0, 2] = math.nan  # read by transfer[2] and average[2], not by last
    per_task = cm.mtil_per_task(upper)
    assert per_task["transfer"][1] == pytest.approx(10.0)
    assert math.isnan(per_task["transfer"][2])
    assert math.isnan(per_task["average"][2])
    with pytest.warns(cm.NotEvaluatedWarning, match=r"mtil_transfer is NaN.*R\[0, 2\]"):
        assert math.isnan(cm.mtil_transfer(upper))
    with pytest.warns(cm.NotEvaluatedWarning, match=r"mtil_average is NaN.*R\[0, 2\]"):
        assert math.isnan(cm.mtil_average(upper))
    assert cm.mtil_last(upper) == pytest.approx(48.0)

    lower = np.array(R)
    lower[2, 0] = math.nan  # read by average[0] and last[0], not by transfer
    assert cm.mtil_transfer(lower) == pytest.approx(17.5)
    with pytest.warns(cm.NotEvaluatedWarning, match=r"R\[2, 0\]"):
        assert math.isnan(cm.mtil_average(lower))
    with pytest.warns(cm.NotEvaluatedWarning, match=r"mtil_last is NaN.*R\[2, 0\]"):
        assert math.isnan(cm.mtil_last(lower))


def test_mtil_single_task() -> None:
    one = [[7.0]]
    assert math.isnan(cm.mtil_transfer(one))
    assert cm.mtil_average(one) == 7.0
    assert cm.mtil_last(one) == 7.0
    per_task = cm.mtil_per_task(one)
    assert math.isnan(per_task["transfer"][0])
    assert per_task["average"].tolist() == [7.0]
    assert per_task["last"].tolist() == [7.0]


def test_mtil_per_task_returns_copies() -> None:
    matrix = np.array(R)
    cm.mtil_per_task(matrix)["last"][0] = -1.0
    assert matrix[2, 0] == 30.0


# Class-incremental, unequal sizes n = [2, 1, 1] on the same R (upper triangle never read):
# A_0 = 50
# A_1 = (2 * 55 + 1 * 60) / 3 = 170 / 3
# A_2 = (2 * 30 + 1 * 45 + 1 * 69) / 4 = 174 / 4 = 43.5
# Avg = (50 + 170/3 + 43.5) / 3 = (150 + 170 + 130.5) / 9 = 450.5 / 9; Last = 43.5
SIZES = [2, 1, 1]


def test_class_incremental_hand_computed_unequal_sizes() -> None:
    np.testing.assert_allclose(cm.class_incremental_per_step(R, SIZES), [50.0, 170 / 3, 43.5])
    assert cm.class_incremental_average(R, SIZES) == pytest.approx(450.5 / 9)
    assert cm.class_incremental_last(R, SIZES) == pytest.approx(43.5)
    # Only the ratios of the sizes matter.
    assert cm.class_incremental_average(R, [200, 100, 100]) == pytest.approx(450.5 / 9)


def test_class_incremental_equal_sizes_match_unweighted_metrics() -> None:
    # n = [5, 5, 5]: A = [50, 57.5, 48] -> Avg = 155.5 / 3, Last = 48.
    assert cm.class_incremental_average(R, [5, 5, 5]) == pytest.approx(155.5 / 3)
    assert cm.class_incremental_average(R, [5, 5, 5]) == pytest.approx(cm.average_incremental(R))
    assert cm.class_incremental_last(R, [5, 5, 5]) == pytest.approx(cm.final_average(R))


def test_class_incremental_nan_propagation() -> None:
    upper = np.array(R)
    upper[0, 1] = upper[0, 2] = upper[1, 2] = math.nan  # not evaluated in class-IL: never read
    assert cm.class_incremental_average(upper, SIZES) == pytest.approx(450.5 / 9)
    assert cm.class_incremental_last(upper, SIZES) == pytest.approx(43.5)

    lower = np.array(R)
    lower[1, 0] = math.nan  # read by A_1 only
    assert math.isnan(cm.class_incremental_per_step(lower, SIZES)[1])
    with pytest.warns(cm.NotEvaluatedWarning, match=r"class_incremental_average is NaN.*R\[1, 0\]"):
        assert math.isnan(cm.class_incremental_average(lower, SIZES))
    assert cm.class_incremental_last(lower, SIZES) == pytest.approx(43.5)


def test_class_incremental_single_task() -> None:
    assert cm.class_incremental_average([[7.0]], [3]) == 7.0
    assert cm.class_incremental_last([[7.0]], [3]) == 7.0


@pytest.mark.parametrize("sizes", [[2, 1], [2, 1, 1, 1], [2, 0, 1], [2, -1, 1], [2, math.nan, 1]])
def test_class_incremental_rejects_bad_sizes(sizes: list[float]) -> None:
    with pytest.raises(ValueError):
        cm.class_incremental_average(R, sizes)


# MoE-Adapters class-incremental logs, github.com/JiazuoYu/MoE-Adapters4CL at 4572d97,
# `cil/experiments/class/<name>-MoE-Adapters/metrics.json`: one JSON line per step with "acc_per_task" (row i of R,
# rounded to 2 decimals) and "acc" (continuum `Logger.accuracy` on all examples of tasks 0..i, rounded), then
# {"last": round(acc_list[-1], 2), "avg": round(statistics.mean(acc_list), 2)} (`cil/main.py` l. 62, 77-78).
# Step sizes from `cil/configs/class/*.yaml` (initial_increment, increment).
MOE_ADAPTERS_LOGS = [
    pytest.param(
        # CIFAR100 test set: 100 images per class, 10 classes per step
        [1000] + [1000] * 9,
        [
            [98.4],
            [96.2, 93.2],
            [90.4, 90.8, 86.6],
            [85.2, 88.5, 78.6, 89.2],
            [82.4, 88.0, 72.2, 83.3, 91.9],
            [80.2, 84.6, 71.2, 82.9, 89.0, 91.6],
            [81.1, 83.0, 68.5, 79.5, 89.7, 89.2, 78.7],
            [79.0, 79.9, 66.5, 76.5, 84.6, 88.2, 77.2, 86.0],
            [80.8, 79.1, 61.9, 76.5, 82.7, 86.1, 71.3, 83.7, 87.6],
            [80.7, 77.3, 54.9, 79.1, 81.0, 87.3, 67.4, 81.8, 85.8, 79.9],
        ],
        [98.4, 94.7, 89.27, 85.38, 83.56, 83.25, 81.39, 79.74, 78.86, 77.52],
        77.52,
        85.21,
        id="cifar100_10-10",
    ),
    pytest.param(
        # TinyImageNet val: 50 images per class; 100 classes first, then 10 per step
        [5000] + [500] * 10,
        [
            [85.46],
            [83.6, 87.0],
            [82.68, 84.8, 82.6],
            [82.28, 81.2, 79.0, 83.6],
            [80.92, 84.8, 78.8, 79.8, 77.0],
            [80.14, 82.8, 80.0, 79.2, 74.6, 75.4],
            [79.48, 83.4, 77.4, 77.4, 74.4, 74.4, 82.2],
            [78.44, 80.2, 78.4, 76.4, 75.4, 72.2, 81.6, 81.4],
            [78.0, 79.0, 77.0, 74.4, 75.2, 71.6, 80.6, 81.0, 75.6],
            [77.56, 77.6, 76.6, 74.0, 74.8, 70.2, 79.6, 79.0, 73.2, 81.2],
            [76.98, 78.6, 77.0, 76.0, 73.0, 70.4, 77.0, 79.0, 75.4, 79.6, 71.2],
        ],
        [85.46, 83.91, 82.85, 82.05, 80.69, 79.56, 79.0, 78.24, 77.47, 76.94, 76.35],
        76.35,
        80.23,
        id="tinyimagenet_100-10",
    ),
    pytest.param(
        # TinyImageNet val: 50 images per class; 100 classes first, then 20 per step
        [5000] + [1000] * 5,
        [
            [85.98],
            [83.72, 85.1],
            [81.72, 82.2, 81.6],
            [80.06, 80.4, 78.0, 81.2],
            [78.28, 79.0, 76.3, 77.7, 79.2],
            [77.42, 76.6, 75.8, 73.6, 76.9, 78.7],
        ],
        [85.98, 83.95, 81.77, 79.99, 78.18, 76.87],
        76.87,
        81.12,
        id="tinyimagenet_100-20",
    ),
]


@pytest.mark.parametrize(("sizes", "rows", "acc", "last", "avg"), MOE_ADAPTERS_LOGS)
def test_moe_adapters_class_incremental_logs(
    sizes: list[int], rows: list[list[float]], acc: list[float], last: float, avg: float
) -> None:
    T = len(rows)
    matrix = np.full((T, T), math.nan)  # upper triangle: never evaluated
    for i, row in enumerate(rows):
        matrix[i, : i + 1] = row
    # Inputs and outputs are rounded to 2 decimals: a weighted mean of values within 0.005, compared with a value
    # within 0.005, differs by at most 0.01.
    np.testing.assert_allclose(cm.class_incremental_per_step(matrix, sizes), acc, atol=0.01, rtol=0)
    assert cm.class_incremental_last(matrix, sizes) == pytest.approx(last, abs=0.01)
    assert cm.class_incremental_average(matrix, sizes) == pytest.approx(avg, abs=0.01)
    if len(set(sizes)) > 1:  # here the unweighted row mean would not give their "acc"
        assert not np.allclose([np.mean(row) for row in rows], acc, atol=0.01)
    # Their "avg" is the mean of the per-step "acc" (iCaRL's average incremental accuracy).
    assert float(np.mean(acc)) == pytest.approx(avg, abs=0.01)
