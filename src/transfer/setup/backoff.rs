//! The pause between connect attempts while nothing listens at the peer yet (it is starting):
//! the TCP connect (refused) and the RDMA CM connect (rejected for want of a listener) both try
//! again after it, until [`crate::transfer::SetupOptions::connect_timeout`].

use std::time::Duration;

/// The first pause.
const FIRST: Duration = Duration::from_millis(10);
/// The longest pause.
const LONGEST: Duration = Duration::from_millis(500);

/// Pauses that double from 10 ms up to half a second.
#[derive(Debug)]
pub(crate) struct Backoff {
    next: Duration,
}

impl Backoff {
    pub(crate) fn new() -> Backoff {
        Backoff { next: FIRST }
    }

    /// The next pause, at most `left` (the time to the deadline).
    pub(crate) fn pause(&mut self, left: Duration) -> Duration {
        let d = self.next.min(left);
        self.next = (self.next * 2).min(LONGEST);
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_up_to_half_a_second_and_never_pass_the_deadline() {
        let mut b = Backoff::new();
        let ms: Vec<u128> = (0..8).map(|_| b.pause(Duration::from_secs(9)).as_millis()).collect();
        assert_eq!(ms, [10, 20, 40, 80, 160, 320, 500, 500]);
        assert_eq!(b.pause(Duration::from_millis(3)), Duration::from_millis(3));
    }
}
