"""The GPU bench CLIs refuse bad flags before they load anything (argparse: exit 2)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "argv",
    [
        ["--depths", "-5"],
        ["--depths", "0,abc"],
        ["--depths", ","],
        ["--variants", "plain,nope"],
        ["--variants", ","],
        ["--greedy", "-1"],
    ],
)
def test_decode_variants_refuses_bad_flags(argv, capsys) -> None:
    from lab.engine import decode_variants  # here, not at collection: it imports the kernels

    with pytest.raises(SystemExit) as exc:
        decode_variants.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("parts", ["profil", ",", "prefetch,nope"])
def test_decode_profile_refuses_unknown_parts(parts, capsys) -> None:
    from lab.engine import decode_profile

    with pytest.raises(SystemExit) as exc:
        decode_profile.main(["--parts", parts])
    assert exc.value.code == 2
    assert "unknown part" in capsys.readouterr().err
