"""``ssm-spec selfcheck`` (ssm_spec/selfcheck.py) covers every registered op."""

import torch

from ssm_spec import selfcheck


def test_selfcheck_covers_every_registered_op():
    registered = set(selfcheck.registered_ops())
    assert {"gdn_verify", "gdn_commit", "gdn_snapshot_verify", "gdn_folded_verify",
            "short_conv_verify", "short_conv_commit"} <= registered  # the enumeration finds them
    rows = selfcheck.run(seed=1)
    covered = {r.op for r in rows if r.what != "registered but not checked by the self-check"}
    assert registered <= covered, f"not covered by the self-check: {sorted(registered - covered)}"
    failed = [r for r in rows if not r.ok]
    assert not failed, failed


def test_an_unchecked_op_is_a_failed_row(monkeypatch):
    """A newly registered op without a check makes the self-check fail, naming it."""
    monkeypatch.setattr(selfcheck, "registered_ops", lambda: ["gdn_verify", "brand_new_op"])
    monkeypatch.setattr(selfcheck, "_gdn_checks", lambda device, dtype, seed: [
        selfcheck.Check("gdn_verify", device.type, str(dtype), "stub", "-", True)])
    monkeypatch.setattr(selfcheck, "_conv_checks", lambda device, seed: [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rows = selfcheck.run(seed=0)
    assert [r.op for r in rows if not r.ok] == ["brand_new_op"]
