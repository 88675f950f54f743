"""A region's mailbox: a take waits for its message, and a new period voids a take that
was still waiting (its period was stopped), so no thread waits forever."""

from __future__ import annotations

import threading

from diloco_ray.regions.mailbox import Mailbox


def take_in_thread(box: Mailbox, key: str) -> dict:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = box.take(key)
        except LookupError as e:
            out["error"] = str(e)

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def test_a_take_waits_for_its_message():
    box = Mailbox()
    waiting = take_in_thread(box, "w/3/0")
    waiting["thread"].join(0.1)
    assert waiting["thread"].is_alive()
    box.put("w/3/0", b"weights")
    waiting["thread"].join(2)
    assert waiting["value"] == b"weights"


def test_a_new_period_voids_a_take_still_waiting_and_drops_old_messages():
    box = Mailbox()
    box.put("w/3/0", b"old")
    waiting = take_in_thread(box, "w/4/0")
    waiting["thread"].join(0.1)
    box.keep(["w/5/0"])
    waiting["thread"].join(2)
    assert "void" in waiting["error"]
    assert "w/3/0" not in box.items  # the last period's messages are gone
