"""Seeds that once broke an invariant: the length they ran, their store, and what they found.

Each bug is fixed in the product with a deterministic test of its own (named in the commit);
the seed stays here so ``python -m tests.chaos --regressions`` replays the whole run it was
found in. A seed replays its schedule for the same length and commit of ``schedule.py``; a kind
of fault or change added there (rank SIGSTOP and guarded changes came after the seeds before
1354943445, a lighthouse rolled back to the old release after all but the last two) draws every
seed's schedule anew, so these replay other schedules now: still runs that once broke something,
no longer the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Regression:
    seed: int
    seconds: float
    store: str
    found: str


REGRESSIONS = (
    Regression(
        1397581936,
        90,
        "etcd",
        "a lighthouse that read another's run end kept its own promises of that run (changes made "
        "between runs took effect above the ended run's steps, and the resumed run trained without "
        "them: test_etcd_lighthouses); two lighthouses each began run 4 (test_etcd_store)",
    ),
    Regression(
        905484450,
        90,
        "etcd",
        "a rank behind its group got a change 181 steps before its effective step (test_step_consistency)",
    ),
    Regression(
        1953042970,
        90,
        "etcd",
        "changes made between runs took effect above the ended run's steps (test_etcd_lighthouses)",
    ),
    Regression(
        4,
        40,
        "etcd",
        "an etcd member stopped on the endpoint in use: every group fell back for steps "
        "(test_etcd_client); replayed, a commit planned at once between runs landed 2 ms into "
        "the run another lighthouse began (test_etcd_store), and the groups of a lighthouse cut "
        "off from etcd trained the fallback for the whole cut (test_etcd_lighthouses)",
    ),
    Regression(
        481063376,
        60,
        "etcd",
        "a lighthouse cut off from etcd was taken for an earlier release and step leases were "
        "suspended (test_etcd_store); a commit held the grants on a hung member",
    ),
    Regression(
        2394,
        40,
        "etcd",
        "a restarted job's new manager stored a lease ceiling between runs, and a change made then "
        "took effect above the ended run's steps (test_etcd_lighthouses)",
    ),
    Regression(
        1009682720,
        90,
        "etcd",
        "after an operator's run end, the next run began on the other lighthouse before the end's "
        "version was stored: two groups trained the ended run's config, one the rebased (test_runs)",
    ),
    Regression(
        882844416,
        90,
        "etcd",
        "a lighthouse cut off from etcd ended the run for managers gone, naming a stale head "
        "(test_etcd_store)",
    ),
    Regression(
        1470347390,
        90,
        "etcd",
        "a lighthouse back from a cut ended three runs the other had just begun, and the groups split "
        "(test_runs)",
    ),
    Regression(
        733702840,
        90,
        "etcd",
        "a lighthouse back from a cut ended the run 60 ms after seeing its groups step elsewhere, and a "
        "group trained another config at the next step (test_runs)",
    ),
    Regression(
        1079626280,
        90,
        "etcd",
        "at a job's first steps a manager of two lighthouses gave a group the fallback after two "
        "refusals of 0.125 s each, before etcd stored the ceiling (test_etcd_lighthouses)",
    ),
    Regression(
        23194112,
        90,
        "etcd",
        "an operator ended the live run while a stopped group was behind: it trained the ended run's "
        "steps on the config as the operator left it (not promised; the checker's exception was keyed "
        "on versions and missed it: test_chaos_checker)",
    ),
    Regression(
        1354943445,
        90,
        "sqlite",
        "a rank SIGSTOPped in the middle of its call woke past its deadline and trained the step on "
        "the fallback while its group's other rank trained the config (test_faults)",
    ),
    Regression(
        639948533,
        90,
        "sqlite",
        "a rank SIGSTOPped 2 ms into its call for 1.7 s trained the step on the fallback: a call "
        "failed under twice its deadline was not asked again (test_faults)",
    ),
    Regression(
        1910554750,
        60,
        "etcd",
        "a group whose manager moved onto a lighthouse of the release before step leases, once the "
        "job's runs began, trained its last config as fresh while the old release lasted: its "
        "answers, of no run era, were dropped as older but counted as contact (test_rolling_upgrade)",
    ),
    Regression(7622960, 60, "etcd", "the same, 8.4 s, in the job's second incarnation"),
    Regression(
        712775808,
        60,
        "etcd",
        "the same, found by a first fix that served the old release's answers: one version named "
        "two configs at a step (past a job's first run it reads a packed step as a step)",
    ),
    Regression(
        434906234,
        90,
        "etcd",
        "a lighthouse back from a cut began a run and promised it to two groups while the run's "
        "record was being written; its watch re-read the store then and took the ended run back, "
        "its promises with it, and a change and a rollback made through it applied at once: two "
        "groups trained steps 4094-4108 on another config than the third (test_runs)",
    ),
    Regression(
        403984614,
        90,
        "etcd",
        "a lease asked of a lighthouse back from a cut waited for its ceiling across the operator's "
        "end of the run, asked again and promised steps to no run: a change made before the next run "
        "began took effect at step 2188 in it, not from its first step, 1996 (test_runs)",
    ),
    Regression(
        216499858,
        90,
        "etcd",
        "a rank restarted 200 steps behind its group after a run began (runs had been suspended "
        "by an old release while the groups stepped between runs): its manager had dropped every "
        "pin at the begin, and the rank got the new run's config for steps its group-mate had "
        "trained with another (test_step_consistency, test_pinning)",
    ),
    Regression(
        788386760,
        45,
        "etcd",
        "an operator ended the run while the job went on, and the group's next step began another: "
        "the manager had dropped every pin at the end, and a rank restarted 14 steps behind its "
        "group got the fallback for steps its group-mate had trained in the ended run "
        "(test_step_consistency, test_pinning)",
    ),
    Regression(
        1931634541,
        45,
        "etcd",
        "the checker's, not the product's: a rank SIGSTOPped while an old release suspended leases "
        "woke after the window and replayed its group's pinned answers; judged by its own time, "
        "they looked like answers given with leases (test_chaos_checker)",
    ),
    Regression(
        2101312727,
        45,
        "etcd",
        "the checker's, not the product's: two etcd leaders killed after an old release died gave "
        "its record's lease the TTL afresh; the lighthouses suspended leases 12 s after its death "
        "(as they must while it is seen) where the checker allowed 8 (test_chaos_checker)",
    ),
)
