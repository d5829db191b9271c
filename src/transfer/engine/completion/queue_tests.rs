//! The ticket table's unit tests.

use super::*;
use crate::transfer::Completed;
use crate::verbs::WcOpcode;

fn done(n: u32) -> Outcome {
    Ok(Completed { byte_len: n, imm: None, opcode: WcOpcode::RdmaWrite })
}

/// The table's counters agree with its tickets.
fn counted(t: &Tickets) {
    let all = || t.ring.iter().flatten().map(|(_, l)| l).chain(t.spill.values());
    assert_eq!(t.completed, all().filter(|l| matches!(l, Lifecycle::Completed(_))).count(), "completed");
    assert_eq!(t.abandoned, all().filter(|l| matches!(l, Lifecycle::Abandoned { .. })).count(), "abandoned");
    assert_eq!(t.any_completed(), t.completed > 0);
}

/// Marks ticket `id` completed, as a reap does.
fn reap(t: &mut Tickets, id: u64) -> bool {
    counted(t);
    let Some(i) = t.find(id) else { return false };
    match t.at(i) {
        Lifecycle::Submitted { .. } => {
            t.complete(i, done(id as u32));
            true
        }
        Lifecycle::Abandoned { .. } => {
            assert!(matches!(t.remove_at(i), Lifecycle::Abandoned { .. }));
            false
        }
        Lifecycle::Completed(_) => false,
    }
}

#[test]
fn tickets_are_claimed_in_and_out_of_order_and_nothing_is_lost() {
    let mut t = Tickets::new(256);
    // Many posted (a queue that never drains: receives kept posted), claimed in order,
    // with new ones posted meanwhile.
    let mut next = 1u64;
    for _ in 0..256 {
        t.submitted(next, 1, "recv");
        next += 1;
    }
    let mut oldest = 1u64;
    for _ in 0..10_000 {
        assert_eq!(t.claim(oldest), None, "not completed yet");
        assert!(t.in_flight(oldest) && !t.is_completed(oldest));
        assert!(reap(&mut t, oldest));
        assert!(t.is_completed(oldest) && !t.in_flight(oldest));
        assert_eq!(t.claim(oldest).unwrap().unwrap().byte_len, oldest as u32);
        assert_eq!(t.claim(oldest), None, "claimed once");
        counted(&t);
        oldest += 1;
        t.submitted(next, 1, "recv");
        next += 1;
        assert_eq!(t.len(), 256);
    }
    // Out of order: complete three, claim the middle one first.
    let (a, b, c) = (oldest, oldest + 1, oldest + 2);
    for id in [a, b, c] {
        assert!(reap(&mut t, id));
    }
    assert!(t.claim(b).is_some() && t.claim(b).is_none());
    assert!(t.claim(c).is_some() && t.claim(a).is_some());
    assert!(t.find(a).is_none() && t.find(b).is_none() && t.find(c).is_none());
    assert!(t.find(c + 1).is_some());
    counted(&t);
}

#[test]
fn abandoned_tickets_keep_their_buffers_until_reaped_or_taken() {
    let mut t = Tickets::new(4);
    for id in 1..=4 {
        t.submitted(id, 2, "RDMA WRITE");
    }
    let i = t.find(2).unwrap();
    t.abandon(i, Box::new(vec![2u8]));
    let i = t.find(4).unwrap();
    t.abandon(i, Box::new(vec![4u8]));
    assert!(t.any_abandoned());
    assert!(t.in_flight(2) && !t.is_completed(2));
    // Reaped: an abandoned ticket leaves the table (its buffer is released by the caller).
    assert!(reap(&mut t, 1) && !reap(&mut t, 2));
    assert!(t.find(2).is_none() && t.any_abandoned());
    // The connection takes back what is still held; completed outcomes stay for waiters.
    let held = t.take_abandoned();
    assert_eq!(held.len(), 1);
    assert!(!t.any_abandoned());
    assert!(t.find(4).is_none() && t.is_completed(1) && t.in_flight(3));
    assert!(t.claim(1).is_some());
    assert!(t.find(3).is_some());
    counted(&t);
}

#[test]
fn a_ticket_left_for_a_turn_of_the_ring_is_kept_aside_and_still_found() {
    let mut t = Tickets::new(8);
    let turn = t.ring.len() as u64;
    assert_eq!(turn, 16, "a depth of 8 has a ring of 16 from the start");
    // Ticket 1 completes and nobody claims it; an abandoned one (2) stays in flight.
    t.submitted(1, 1, "SEND");
    t.submitted(2, 1, "SEND");
    assert!(reap(&mut t, 1));
    let i = t.find(2).unwrap();
    t.abandon(i, Box::new(7u8));
    // A whole turn later, new tickets land on their slots: the unclaimed outcome moves
    // aside; the one still in flight keeps its slot (the ring is at its largest), so the
    // newcomer goes aside.
    for id in 3..=turn + 2 {
        t.submitted(id, 1, "SEND");
        assert!(reap(&mut t, id));
        assert!(t.claim(id).is_some(), "ticket {id} claimed");
    }
    assert_eq!(t.spill.len(), 1);
    assert_eq!(t.find(1), Some(At::Spill(1)));
    assert!(t.in_flight(2) && t.any_abandoned());
    assert!(t.is_completed(1));
    // Still found, claimed once, reaped once.
    counted(&t);
    assert!(t.claim(1).is_some() && t.claim(1).is_none());
    counted(&t);
    assert!(!reap(&mut t, 2) && t.find(2).is_none() && !t.any_abandoned());
    assert!(t.spill.is_empty());
    // The slots those two had work as before.
    t.submitted(turn + 1, 1, "SEND");
    assert!(matches!(t.find(turn + 1), Some(At::Ring(_))));
}

#[test]
fn the_ring_grows_with_the_requests_in_flight_and_nothing_is_lost() {
    let mut t = Tickets::new(256);
    assert_eq!(t.ring.len(), FIRST_RING, "an idle queue's ring is small");
    for id in 1..=200 {
        t.submitted(id, 1, "RDMA WRITE");
    }
    assert_eq!(t.ring.len(), 256, "grown to hold the 200 in flight");
    assert!(t.spill.is_empty(), "none aside while the ring could grow");
    let i = t.find(7).unwrap();
    t.abandon(i, Box::new(7u8));
    for id in 1..=200 {
        assert!(t.in_flight(id), "ticket {id} kept");
    }
    // Many outcomes left unclaimed (Pendings never waited for): the spill takes the
    // oldest, and claims in posting order stay cheap (a map, not a scan).
    for id in 1..=200 {
        reap(&mut t, id);
    }
    for id in 201..=5000 {
        t.submitted(id, 1, "RDMA WRITE");
        reap(&mut t, id);
    }
    assert_eq!(t.ring.len(), 256, "unclaimed outcomes move aside: they do not grow the ring");
    assert!(!t.any_abandoned());
    for id in (1..=5000).filter(|&id| id != 7) {
        assert!(t.claim(id).is_some(), "ticket {id} claimed");
    }
    assert_eq!(t.len(), 0);
    counted(&t);
}

/// Random posts, reaps (storing the outcome or handing it to its waiter), claims, parks of
/// submitted and of completed tickets and `take_abandoned`, at small and large depths: the
/// counters agree with the table after every step, no live ticket is lost, and no completed
/// ticket exists while `any_completed` says none (a waiter would skip it).
#[test]
fn random_lifecycles_keep_the_counters_exact() {
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut rnd = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for depth in [1u32, 4, 8, 16, 64] {
        let mut t = Tickets::new(depth);
        let mut next = 1u64;
        // Posted, not yet claimed or removed.
        let mut live: Vec<u64> = Vec::new();
        for _ in 0..20_000 {
            match rnd(8) {
                0 | 1 => {
                    t.submitted(next, 1, "x");
                    live.push(next);
                    next += 1;
                }
                2 | 3 if !live.is_empty() => {
                    // A reap of one of the oldest; sometimes by its own waiter (handed back).
                    let k = rnd(live.len().min(3) as u64) as usize;
                    let id = live[k];
                    let at = t.find(id).unwrap_or_else(|| panic!("live ticket {id} lost"));
                    match t.at(at) {
                        Lifecycle::Submitted { .. } if rnd(2) == 0 => {
                            t.remove_at(at);
                            live.remove(k);
                        }
                        Lifecycle::Submitted { .. } => t.complete(at, done(id as u32)),
                        Lifecycle::Abandoned { .. } => {
                            t.remove_at(at);
                            live.remove(k);
                        }
                        Lifecycle::Completed(_) => {}
                    }
                }
                4 | 5 if !live.is_empty() => {
                    let k = rnd(live.len() as u64) as usize;
                    let id = live[k];
                    let completed = t.is_completed(id);
                    assert!(!completed || t.any_completed(), "a completed ticket while the count says none");
                    match t.claim(id) {
                        Some(o) => {
                            assert!(completed);
                            assert_eq!(o.unwrap().byte_len, id as u32);
                            live.remove(k);
                        }
                        None => assert!(!completed),
                    }
                }
                6 if !live.is_empty() => {
                    // A dropped Pending parks its buffer (a completed one's is released at once).
                    let k = rnd(live.len() as u64) as usize;
                    let id = live[k];
                    let at = t.find(id).expect("a live ticket");
                    match t.at(at) {
                        Lifecycle::Submitted { .. } => t.abandon(at, Box::new(id)),
                        Lifecycle::Completed(_) => {
                            assert!(matches!(t.remove_at(at), Lifecycle::Completed(_)));
                            live.remove(k);
                        }
                        Lifecycle::Abandoned { .. } => {}
                    }
                }
                7 if rnd(500) == 0 => {
                    let n = t.take_abandoned().len();
                    let before = live.len();
                    live.retain(|&id| t.find(id).is_some());
                    assert_eq!(before - live.len(), n);
                }
                _ => {}
            }
            counted(&t);
            assert_eq!(t.len(), live.len());
        }
    }
}
