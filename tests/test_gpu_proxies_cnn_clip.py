"""GPU proxies on the CPU (issue: CUDA-only crashes no CPU test saw), FedOTP's and FedPFT's methods and variants."""
import pytest

from gpu_proxies import check_under_gpu_rules, runs_of


@pytest.mark.parametrize("experiment, method", runs_of("fedotp", "fedpft"))
def test_runs_under_cuda_rules_and_keeps_its_server_side_on_the_run_device(experiment, method, tiny_method_root,
                                                                          tmp_path, monkeypatch):
    check_under_gpu_rules(experiment, method, tiny_method_root, tmp_path, monkeypatch)


def test_the_dtype_proxy_fails_without_the_engines_fp32_batch_norm(tiny_method_root, tmp_path, monkeypatch):
    """FedPFT's clients trained together crashed on CUDA: its vmapped convolutions give bf16 there, and the BatchNorm
    after them refused its fp32 running statistics. The proxy meets that error on the CPU when the engine does not
    run BatchNorm in its own dtype."""
    import contextlib

    from fedcore.engine import together

    monkeypatch.setattr(together, "batchnorm_in_own_dtype", lambda model: contextlib.nullcontext())
    with pytest.raises(RuntimeError, match="expected scalar type BFloat16 but found Float"):
        check_under_gpu_rules("pft_c10_dir0p1", "fedpft", tiny_method_root, tmp_path, monkeypatch)
