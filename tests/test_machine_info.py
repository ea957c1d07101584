"""The ``machine`` section: enough to tell whether two machines compute a run's numbers alike."""

import subprocess
import sys

import torch

from scripts.machine_info import machine_info, numerics_fingerprint


def test_numerics_fingerprint_is_stable_and_leaves_the_thread_count_alone():
    before = torch.get_num_threads()
    first = numerics_fingerprint(threads=1)
    assert torch.get_num_threads() == before
    assert first == numerics_fingerprint(threads=1)
    assert len(first) == 16 and int(first, 16) >= 0


def test_numerics_fingerprint_is_the_same_in_another_process():
    # The same machine, build and thread count must agree across processes, or the fingerprint could
    # not tell machines apart from noise.
    code = "from scripts.machine_info import numerics_fingerprint; print(numerics_fingerprint(threads=1))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == numerics_fingerprint(threads=1)


def test_numerics_fingerprint_sees_another_summation_order():
    # The same product summed in two unequal parts rounds differently in float32: the fingerprint must move.
    def whole(generator):
        a, b = torch.randn(64, 256, generator=generator), torch.randn(256, 64, generator=generator)
        return [a @ b]

    def two_parts(generator):
        a, b = torch.randn(64, 256, generator=generator), torch.randn(256, 64, generator=generator)
        return [a[:, :100] @ b[:100] + a[:, 100:] @ b[100:]]

    assert torch.allclose(whole(torch.Generator().manual_seed(0))[0], two_parts(torch.Generator().manual_seed(0))[0], atol=1e-4)
    assert numerics_fingerprint(1, whole) != numerics_fingerprint(1, two_parts)


def test_machine_info_names_the_instruction_set_and_fingerprints():
    info = machine_info()
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(info["numerics_fingerprint"]) == {"1", str(torch.get_num_threads())}
