"""convert keeps what trained digits models compute: accuracy at a quarter of the size."""
from __future__ import annotations

import copy

from panther_lite import convert


def converted_accuracies(model, head, x_train, x_test, y_test, accuracy):
    """Test accuracy after converting copies at param_ratio=0.25 (the classifier head, whose
    budget allows only rank 2 of 10, stays dense) with each init."""
    results = {}
    for name, kwargs in (
        ("svd", {}),
        ("calibrated", dict(calibration_data=x_train.split(256))),
        ("sketch", dict(init="sketch", seed=0)),
    ):
        model_copy = copy.deepcopy(model)
        report = convert(model_copy, param_ratio=0.25, exclude_modules=[head], progress=False, **kwargs)
        results[name] = (accuracy(model_copy, x_test, y_test), report)
    return results


def test_mlp_keeps_accuracy_at_a_quarter_of_the_size(digits, trained_mlp, accuracy):
    x, _, x_test, y_test = digits
    dense = accuracy(trained_mlp, x_test, y_test)
    results = converted_accuracies(trained_mlp, "4", x, x_test, y_test, accuracy)
    assert dense > 0.93
    for name in ("svd", "calibrated"):
        acc, report = results[name]
        assert acc >= dense - 0.01, (name, acc, dense)
        assert list(report["status"]) == ["converted", "converted"]
        assert (report["stored_ratio"] <= 0.25).all()
        assert (report["init"] == name).all()
    assert results["sketch"][0] < dense - 0.3  # the anchor's conversion turns the model into noise
    # The calibrated fit is the output-optimal one: no worse than the weight fit on that data.
    svd_report = convert(copy.deepcopy(trained_mlp), param_ratio=0.25, exclude_modules=["4"],
                         calibration_data=[x], init="svd", progress=False)
    calibrated = results["calibrated"][1]
    assert (calibrated["output_error"].to_numpy() <= svd_report["output_error"].to_numpy() * (1 + 1e-3)).all()
    assert (calibrated["weight_error"].to_numpy() >= svd_report["weight_error"].to_numpy() * (1 - 1e-9)).all()


def test_cnn_keeps_accuracy_and_keeps_tiny_conv_dense(digits, trained_cnn, accuracy):
    x, _, x_test, y_test = digits
    x, x_test = x.view(-1, 1, 8, 8), x_test.view(-1, 1, 8, 8)
    dense = accuracy(trained_cnn, x_test, y_test)
    results = converted_accuracies(trained_cnn, "8", x, x_test, y_test, accuracy)
    assert dense > 0.93
    for name in ("svd", "calibrated"):
        assert results[name][0] >= dense - 0.01, (name, results[name][0], dense)
    assert results["sketch"][0] < dense - 0.3
    report = results["calibrated"][1]
    assert list(report["kind"]) == ["Conv2d", "Conv2d", "Linear"]
    assert list(report["status"]) == ["kept dense", "converted", "converted"]
    assert "0.25" in report.loc[0, "reason"]
    assert report.loc[0, "stored_params"] == report.loc[0, "dense_params"] == 32 * 9 + 32
