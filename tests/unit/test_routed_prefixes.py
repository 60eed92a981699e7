"""The router's memory of where it sent each page key (cluster/core/routed_prefixes.py)."""

import pytest

from cluster.core.routed_prefixes import RoutedPrefixes

KEYS = [bytes([i]) * 16 for i in range(8)]
A_HOST = (("node-a", 1),)


def test_pages_past_the_directory_s_prefix_count_as_held_where_they_were_routed():
    routed = RoutedPrefixes(ttl_s=3.0)
    routed.record(KEYS[:6], "node-b", now_s=10.0)
    located = routed.extend([A_HOST, A_HOST], KEYS, now_s=11.0)
    assert located[:2] == [A_HOST, A_HOST]  # the directory's answer is kept as it is
    assert located[2:] == [(("node-b", 0),)] * 4  # pages 2..5, in node-b's top tier
    assert all(p is located[2] for p in located[2:])  # one run shares one places tuple


def test_nothing_routed_or_all_expired_leaves_the_answer_alone():
    routed = RoutedPrefixes(ttl_s=3.0)
    answer = [A_HOST]
    assert routed.extend(answer, KEYS, now_s=0.0) is answer
    routed.record(KEYS, "node-b", now_s=0.0)
    assert routed.extend([], KEYS, now_s=3.0) == []  # expired at exactly ttl_s
    assert len(routed) == 0


def test_a_prediction_stops_where_the_routed_node_changes_or_a_key_is_missing():
    routed = RoutedPrefixes(ttl_s=3.0)
    routed.record(KEYS[:3], "node-a", now_s=0.0)
    routed.record(KEYS[3:5], "node-b", now_s=0.0)
    assert len(routed.extend([], KEYS, now_s=1.0)) == 3
    routed.record(KEYS[:2], "node-c", now_s=1.0)  # a later request moved the first two
    assert routed.extend([], KEYS, now_s=1.5) == [(("node-c", 0),)] * 2
    assert routed.extend([], [KEYS[7], *KEYS], now_s=1.5) == []  # first key never routed


def test_it_holds_at_most_max_keys_dropping_the_oldest():
    routed = RoutedPrefixes(ttl_s=60.0, max_keys=4)
    routed.record(KEYS[:3], "node-a", now_s=0.0)
    routed.record(KEYS[3:6], "node-a", now_s=1.0)
    assert len(routed) == 4
    assert routed.extend([], KEYS, now_s=2.0) == []  # KEYS[0] was dropped
    assert len(routed.extend([], KEYS[2:], now_s=2.0)) == 4


@pytest.mark.parametrize("ttl_s,max_keys", [(0.0, 10), (1.0, 0)])
def test_bad_settings_are_refused(ttl_s, max_keys):
    with pytest.raises(ValueError):
        RoutedPrefixes(ttl_s=ttl_s, max_keys=max_keys)
