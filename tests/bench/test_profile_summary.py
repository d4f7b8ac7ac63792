from trtglm.bench.profile_summary import summarise


def test_frames_are_counted_at_the_top_and_anywhere_in_their_stacks():
    lines = ["main (a.py:1);step (b.py:2);wait (c.py:3) 6", "main (a.py:1);step (b.py:2) 3",
             "main (a.py:1);send (d.py:4);step (b.py:2) 1", "not a stack", ""]
    total, own, inclusive = summarise(lines)
    assert total == 10
    assert own == {"wait (c.py:3)": 6, "step (b.py:2)": 4}
    assert inclusive["main (a.py:1)"] == 10 and inclusive["step (b.py:2)"] == 10 and inclusive["send (d.py:4)"] == 1
