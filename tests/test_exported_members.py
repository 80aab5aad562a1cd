import gym_ray


def test_all_is_sorted_public_names() -> None:
    exported = [name for name in dir(gym_ray) if not name.startswith("_") or name == "__version__"]
    public = sorted(n for n in exported if n in gym_ray.__all__)
    assert gym_ray.__all__ == sorted(gym_ray.__all__)
    assert public == sorted(gym_ray.__all__)
