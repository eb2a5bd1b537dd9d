import pytest

from semver import Version

P = Version.parse


def test_parse_fields():
    v = P("1.2.3-alpha.1+build.5")
    assert (v.major, v.minor, v.patch) == (1, 2, 3)
    assert v.prerelease == ("alpha", 1)
    assert v.build == ("build", "5")
    assert str(v) == "1.2.3-alpha.1+build.5"


def test_core_ordering():
    assert P("1.0.0") < P("2.0.0") < P("2.1.0") < P("2.1.1")
    assert P("1.10.0") > P("1.9.0")


def test_ordering_is_not_true_both_ways():
    # Each comparison also checked in reverse: an object that says yes to every
    # comparison fails here.
    low, high = P("1.9.0"), P("1.10.0")
    assert not (high < low) and not (low > high)
    assert not (high <= low) and not (low >= high)
    assert low != high and not (low == high)
    assert not (P("1.0.0") < P("1.0.0-rc.1"))
    assert not (P("1.0.0-alpha.beta") < P("1.0.0-alpha.1"))


def test_sorting_shuffled_versions():
    chain = ["0.9.9", "1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-beta.2", "1.0.0-beta.11", "1.0.0", "1.0.1", "1.10.0",
             "2.0.0"]
    shuffled = [chain[i] for i in (4, 0, 7, 2, 8, 5, 1, 6, 3)]
    assert [str(v) for v in sorted(P(s) for s in shuffled)] == chain
    assert str(max(P(s) for s in shuffled)) == "2.0.0" and str(min(P(s) for s in shuffled)) == "0.9.9"


def test_spec_precedence_chain():
    chain = ["1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta",
             "1.0.0-beta.2", "1.0.0-beta.11", "1.0.0-rc.1", "1.0.0"]
    versions = [P(s) for s in chain]
    assert sorted(reversed(versions)) == versions
    assert all(a < b for a, b in zip(versions, versions[1:]))


def test_build_metadata_ignored():
    assert P("1.0.0+a") == P("1.0.0+b")
    assert hash(P("1.0.0+a")) == hash(P("1.0.0"))
    assert len({P("1.0.0+x"), P("1.0.0"), P("1.0.1")}) == 2


@pytest.mark.parametrize("bad", ["1.2", "1.2.3.4", "01.2.3", "1.2.3-", "1.2.3-01", "1.2.3+", "v1.2.3", "1.2.3-a..b", "a.b.c"])
def test_invalid(bad):
    with pytest.raises(ValueError):
        P(bad)


def test_alphanumeric_with_leading_zero_digits_is_fine():
    assert P("1.0.0-0a").prerelease == ("0a",)
