"""A tenant's fair share of a worker alone: below it or not, the priority it gets, the credits it may
take. The links are plain records of what the share reads (free credits, the stream's credits and its
LinkLoad); no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.admission import Priority
from gateway.credits import StreamCredits
from gateway.fair_share import FairShare
from gateway.forecast import LinkLoad
from strata.v1 import common_pb2, worker_pb2


def submission(name: str, prompt: int, new: int = 12) -> worker_pb2.Submission:
    sampling = common_pb2.SamplingParams(max_new_tokens=new)
    return worker_pb2.Submission(request_id=name, prompt_ids=[1] * prompt, sampling=sampling)


@dataclass
class Link:
    free_credits: int
    credits: StreamCredits = field(default_factory=StreamCredits)
    load: LinkLoad = field(default_factory=LinkLoad)


def test_a_tenant_is_under_share_while_it_holds_less_than_its_weighted_part_of_the_open_cost() -> None:
    share = FairShare({"heavy": 3.0}, 0.0, on=True)
    load = LinkLoad()
    assert not share.favoured("quiet", load)  # nothing open: nobody to be favoured over
    load.sent(submission("n1", prompt=500), tenant="noisy")
    assert share.favoured("quiet", load)
    assert not share.favoured("noisy", load)  # alone, it holds all of its share
    load.sent(submission("q1", prompt=20), tenant="quiet")
    assert share.favoured("quiet", load) and not share.favoured("noisy", load)
    # Weight 3 of 5: 3/5 of (512 + 32) = 326 tokens is its share, and it holds none.
    assert share.favoured("heavy", load)
    load.sent(submission("h1", prompt=300), tenant="heavy")
    assert share.favoured("heavy", load)  # 312 < 3/5 x 856
    load.sent(submission("h2", prompt=500), tenant="heavy")
    assert not share.favoured("heavy", load)  # 824 >= 3/5 x 1368
    assert load.tenant_costs() == {"noisy": 512, "quiet": 32, "heavy": 824}
    off = FairShare({"heavy": 3.0}, 0.0, on=False)
    assert not off.favoured("quiet", load) and off.weight("heavy") == 3.0 and off.weight("other") == 1.0


def test_a_favoured_request_goes_one_priority_up_never_past_the_class_above() -> None:
    share = FairShare({}, 0.0, on=True)
    load = LinkLoad()
    load.sent(submission("n1", prompt=500), tenant="noisy")
    assert share.worker_priority(Priority.INTERACTIVE, "quiet", load) == 1
    assert share.worker_priority(Priority.INTERACTIVE, "noisy", load) == 0
    batch = share.worker_priority(Priority.BATCH, "quiet", load)
    assert share.worker_priority(Priority.BATCH, "noisy", load) < batch < 0


def test_the_reserve_is_kept_from_tenants_at_their_share_and_only_beyond_the_running_limit() -> None:
    """A quarter of 8 credits is 2, kept from a tenant at its share while the worker runs 4 at once;
    a tenant below its share takes every free credit; with 7 running slots only 1 credit lies beyond
    them, so only 1 is kept (a lone tenant still fills every slot); fair queuing off keeps none."""
    share = FairShare({}, 0.25, on=True)
    link = Link(free_credits=5)
    link.credits.reset(limit=8, reported=8)
    link.load.max_running = 4
    link.load.sent(submission("n1", prompt=500), tenant="noisy")
    assert share.usable_credits("noisy", link) == 3
    assert share.usable_credits("quiet", link) == 5
    link.load.max_running = 7
    assert share.usable_credits("noisy", link) == 4
    assert FairShare({}, 0.25, on=False).usable_credits("noisy", link) == 5
    assert share.usable_credits("noisy", Link(free_credits=0)) == 0
