"""Continual metrics on a hand-computed 3 x 3 matrix, the TiC identity and the T = 1 convention."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from hf_ccl.evaluation import continual_metrics as cm

# R[i, j]: score on task j after training task i. Task 0 improves after task 1 (55 > 50), so forgetting
# (max over earlier rows) and backward transfer (diagonal only) differ.
R = [
    [50.0, 10.0, 20.0],
    [55.0, 60.0, 30.0],
    [30.0, 45.0, 69.0],
]
B = [5.0, 8.0, 12.0]  # initial model

# Hand-computed:
FINAL = (30 + 45 + 69) / 3  # 48
AVG_INC = (50 + (55 + 60) / 2 + (30 + 45 + 69) / 3) / 3  # (50 + 57.5 + 48) / 3 = 51.8333
FORGETTING = ((55 - 30) + (60 - 45)) / 2  # j=0: max(50, 55) - 30 = 25; j=1: 60 - 45 = 15 -> 20
BWT = ((30 - 50) + (45 - 60)) / 2  # -17.5
FWT = ((10 - 8) + (30 - 12)) / 2  # R[0,1] - b[1] = 2; R[1,2] - b[2] = 18 -> 10
TIC_ID = (50 + 60 + 69) / 3  # 59.6667
TIC_BWT = (55 + 30 + 45) / 3  # strict lower triangle / (T(T-1)/2 = 3) = 43.3333
TIC_FWT = (10 + 20 + 30) / 3  # strict upper triangle = 20
TIC_REL_BWT = ((55 - 60) + (30 - 69) + (45 - 69)) / 3  # -68 / 3
TIC_REL_FWT = ((10 - 50) + (20 - 50) + (30 - 60)) / 3  # -100 / 3


def test_hand_computed_values() -> None:
    assert cm.final_average(R) == pytest.approx(48.0)
    assert cm.average_incremental(R) == pytest.approx(155.5 / 3)
    assert cm.forgetting(R) == pytest.approx(20.0)
    assert cm.backward_transfer(R) == pytest.approx(-17.5)
    assert cm.forward_transfer(R, B) == pytest.approx(10.0)
    assert cm.tic_in_domain(R) == pytest.approx(179 / 3)
    assert cm.tic_backward(R) == pytest.approx(130 / 3)
    assert cm.tic_forward(R) == pytest.approx(20.0)
    assert cm.tic_relative_backward(R) == pytest.approx(-68 / 3)
    assert cm.tic_relative_forward(R) == pytest.approx(-100 / 3)


def test_summarize_keys_and_values() -> None:
    summary = cm.summarize(np.array(R), B)
    assert summary == pytest.approx(
        {
            "final_average": FINAL,
            "average_incremental": AVG_INC,
            "forgetting": FORGETTING,
            "backward_transfer": BWT,
            "tic_id": TIC_ID,
            "tic_bwt": TIC_BWT,
            "tic_fwt": TIC_FWT,
            "tic_rel_bwt": TIC_REL_BWT,
            "tic_rel_fwt": TIC_REL_FWT,
            "forward_transfer": FWT,
            "initial_average": 25 / 3,
            "mtil_transfer": cm.mtil_transfer(R),
            "mtil_average": cm.mtil_average(R),
            "mtil_last": FINAL,
        }
    )
    assert "forward_transfer" not in cm.summarize(R)
    assert "class_incremental_average" not in summary
    with_sizes = cm.summarize(R, sizes=[2, 1, 1])
    assert with_sizes["class_incremental_average"] == pytest.approx(cm.class_incremental_average(R, [2, 1, 1]))
    assert with_sizes["class_incremental_last"] == pytest.approx(cm.class_incremental_last(R, [2, 1, 1]))


def _tic_identity_holds(matrix: np.ndarray) -> bool:
    lhs = (
        (cm.tic_backward(matrix) - cm.tic_relative_backward(matrix))
        + (cm.tic_forward(matrix) - cm.tic_relative_forward(matrix))
    ) / 2
    return math.isclose(lhs, cm.tic_in_domain(matrix), rel_tol=1e-12, abs_tol=1e-9)


def test_tic_identity_hand_matrix() -> None:
    # ((43.333 + 22.667) + (20 + 33.333)) / 2 = 59.667 = ID
    assert ((TIC_BWT - TIC_REL_BWT) + (TIC_FWT - TIC_REL_FWT)) / 2 == pytest.approx(TIC_ID)
    assert _tic_identity_holds(np.array(R))


@pytest.mark.parametrize("T", [2, 3, 4, 7])
def test_tic_identity_random(T: int) -> None:
    rng = np.random.default_rng(T)
    for _ in range(5):
        assert _tic_identity_holds(rng.uniform(0, 100, size=(T, T)))


def test_four_by_four_by_hand() -> None:
    R4 = np.array(
        [
            [10.0, 1.0, 2.0, 3.0],
            [8.0, 20.0, 4.0, 5.0],
            [9.0, 15.0, 30.0, 6.0],
            [7.0, 12.0, 25.0, 40.0],
        ]
    )
    assert cm.final_average(R4) == pytest.approx((7 + 12 + 25 + 40) / 4)  # 21
    # forgetting: j0 max(10,8,9)-7=3; j1 max(20,15)-12=8; j2 30-25=5 -> 16/3
    assert cm.forgetting(R4) == pytest.approx(16 / 3)
    assert cm.backward_transfer(R4) == pytest.approx(((7 - 10) + (12 - 20) + (25 - 30)) / 3)
    assert cm.tic_backward(R4) == pytest.approx((8 + 9 + 15 + 7 + 12 + 25) / 6)
    assert cm.tic_forward(R4) == pytest.approx((1 + 2 + 3 + 4 + 5 + 6) / 6)
    assert cm.forward_transfer(R4, [0, 0, 0, 0]) == pytest.approx((1 + 4 + 6) / 3)


def test_single_task_is_nan_where_undefined() -> None:
    summary = cm.summarize([[42.0]], [7.0])
    assert summary["final_average"] == 42.0
    assert summary["average_incremental"] == 42.0
    assert summary["tic_id"] == 42.0
    for key in ("forgetting", "backward_transfer", "forward_transfer", "tic_bwt", "tic_fwt", "tic_rel_bwt"):
        assert math.isnan(summary[key]), key


def test_nan_cells_propagate() -> None:
    matrix = np.array(R)
    matrix[2, 0] = np.nan
    with pytest.warns(cm.NotEvaluatedWarning):
        assert math.isnan(cm.final_average(matrix))
    assert cm.tic_forward(matrix) == pytest.approx(20.0)  # upper triangle does not read the NaN


def test_shape_checks() -> None:
    with pytest.raises(ValueError, match="square"):
        cm.final_average([[1.0, 2.0]])
    with pytest.raises(ValueError, match="square"):
        cm.summarize(np.zeros((0, 0)))
    with pytest.raises(ValueError, match="length"):
        cm.forward_transfer(R, [1.0, 2.0])


# ----- bad values (issue 25, item 11): infinite or out-of-range cells, fractions, NaN cells named ------------------
def test_infinite_and_out_of_range_cells_are_refused_by_name() -> None:
    matrix = np.array(R)
    matrix[2, 0] = -np.inf
    with pytest.raises(ValueError, match=r"finite.*R\[2, 0\] = -inf"):
        cm.forgetting(matrix)
    with pytest.raises(ValueError, match=r"finite.*b\[1\] = inf"):
        cm.forward_transfer(R, [5.0, np.inf, 12.0])
    with pytest.raises(ValueError, match=r"\[0, 100\] \(percent\): R\[1, 2\] = 130"):
        cm.summarize([[50.0, 10.0, 20.0], [55.0, 60.0, 130.0], [30.0, 45.0, 69.0]])
    with pytest.raises(ValueError, match=r"R\[0, 0\] = -5"):
        cm.final_average([[-5.0]])


def test_fractions_are_refused_unless_the_scale_says_so() -> None:
    fractions = np.array(R) / 100
    for function in (cm.final_average, cm.forgetting, cm.tic_backward, cm.mtil_transfer):
        with pytest.raises(ValueError, match=r"every score lies in \[0, 1\].*scale='fraction'"):
            function(fractions)
    with pytest.raises(ValueError, match=r"every score lies in \[0, 1\]"):
        cm.summarize(fractions, np.array(B) / 100)
    assert cm.forgetting(fractions, scale="fraction") == pytest.approx(FORGETTING / 100)
    summary = cm.summarize(fractions, np.array(B) / 100, scale="fraction")
    assert summary == pytest.approx({key: value / 100 for key, value in cm.summarize(R, B).items()})
    weak = np.full((2, 2), 0.4)  # percentages that are all small: a weak model's Recall@1
    assert cm.final_average(weak, scale="percent") == pytest.approx(0.4)
    with pytest.raises(ValueError, match=r"\[0, 1\] \(fraction\): R\[0, 0\] = 50"):
        cm.final_average(R, scale="fraction")
    with pytest.raises(ValueError, match="scale must be"):
        cm.final_average(R, scale="percentage")
    assert cm.forward_transfer(R, [0.0, 0.0, 0.0]) == pytest.approx(20.0)  # b all 0: R says the scale


def test_nan_cells_are_named_when_they_make_a_summary_nan() -> None:
    matrix = np.array(R)
    matrix[2, 0] = np.nan
    with pytest.warns(cm.NotEvaluatedWarning, match=r"final_average is NaN: it reads cells marked not evaluated "
                                                      r"\(NaN\): R\[2, 0\]"):
        assert math.isnan(cm.final_average(matrix))
    with pytest.warns(cm.NotEvaluatedWarning) as caught:
        summary = cm.summarize(matrix, B)
    assert len(caught) == 1  # one warning naming every NaN key
    nan_keys = sorted(key for key, value in summary.items() if math.isnan(value))
    assert nan_keys and str(caught[0].message).startswith(", ".join(k for k in summary if k in nan_keys) + " are NaN")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm.summarize([[42.0]], [7.0])  # NaN by the T = 1 convention: no warning
        assert cm.tic_forward(matrix) == pytest.approx(20.0)  # does not read the NaN cell
