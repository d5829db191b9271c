//! The end of a striped transfer ([`Finished`]) and what each rail did for it ([`RailReport`]).

use crate::error::{Error, Result};

/// What one rail did for a transfer ([`Finished::rails`]).
#[derive(Debug)]
pub struct RailReport {
    /// The rail's index in the group.
    pub rail: usize,
    /// This side's device.
    pub device: String,
    /// Bytes its completed slices moved.
    pub bytes: u64,
    /// Slices it completed.
    pub slices: u64,
    /// Slices that failed with it and were posted again on another rail.
    pub reposted: u64,
    /// Why the rail is dead at the end of the transfer, if it is: the error a slice of this
    /// transfer met on it, else its connection's first failure.
    pub failure: Option<Error>,
}

/// The end of a striped transfer: the buffers, an outcome per piece, what each rail did.
#[must_use = "pieces of a transfer may have failed: check Finished::is_ok or use into_result"]
pub struct Finished<B> {
    bufs: Option<Vec<B>>,
    errors: Vec<Option<Error>>,
    rails: Vec<RailReport>,
}

impl<B> std::fmt::Debug for Finished<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Finished").field("errors", &self.errors).field("rails", &self.rails).finish()
    }
}

impl RailReport {
    pub(crate) fn blank(rail: usize, device: &str) -> RailReport {
        RailReport { rail, device: device.to_string(), bytes: 0, slices: 0, reposted: 0, failure: None }
    }
}

impl<B> Finished<B> {
    pub(crate) fn new(bufs: Option<Vec<B>>, errors: Vec<Option<Error>>, rails: Vec<RailReport>) -> Finished<B> {
        Finished { bufs, errors, rails }
    }

    /// A one-piece transfer refused before anything was posted: its buffer back with why.
    #[cfg(feature = "tokio")]
    pub(crate) fn refused(buf: B, error: Error, rails: Vec<RailReport>) -> Finished<B> {
        Finished { bufs: Some(vec![buf]), errors: vec![Some(error)], rails }
    }

    /// Whether every piece arrived.
    pub fn is_ok(&self) -> bool {
        self.errors.iter().all(Option::is_none)
    }

    /// The pieces that failed, with why (index into the list given).
    pub fn piece_errors(&self) -> impl Iterator<Item = (usize, &Error)> {
        self.errors.iter().enumerate().filter_map(|(i, e)| e.as_ref().map(|e| (i, e)))
    }

    /// What each rail did, in rail order.
    pub fn rails(&self) -> &[RailReport] {
        &self.rails
    }

    /// The buffers, in the order given (`None` if a flush never came: then they are leaked,
    /// the NIC may still use them), an outcome per piece, and the rails' reports.
    pub fn into_parts(self) -> (Option<Vec<B>>, Vec<Option<Error>>, Vec<RailReport>) {
        (self.bufs, self.errors, self.rails)
    }

    /// The buffer of a one-buffer transfer ([`Rails::post_write`](crate::transfer::Rails::post_write),
    /// [`Rails::post_read`](crate::transfer::Rails::post_read)) and the rails' reports, if it
    /// arrived. (Of a list, the first buffer; the others are dropped.)
    ///
    /// # Errors
    /// As [`Finished::into_result`].
    pub fn into_one(self) -> Result<(B, Vec<RailReport>)> {
        let (bufs, rails) = self.into_result()?;
        match bufs.into_iter().next() {
            Some(buf) => Ok((buf, rails)),
            None => Err(Error::InvalidArgument("a transfer of no pieces has no buffer".into())),
        }
    }

    /// The buffers and the rails' reports if every piece arrived.
    ///
    /// # Errors
    /// [`Error::PiecesFailed`] with the first piece's error if any failed (the buffers are
    /// dropped: use [`Finished::into_parts`] to keep them).
    pub fn into_result(self) -> Result<(Vec<B>, Vec<RailReport>)> {
        let failed = self.errors.iter().filter(|e| e.is_some()).count();
        let pieces = self.errors.len();
        match (self.errors.into_iter().flatten().next(), self.bufs) {
            (None, Some(bufs)) => Ok((bufs, self.rails)),
            (first, _) => Err(Error::PiecesFailed {
                failed: failed.max(1),
                pieces,
                first: Box::new(first.unwrap_or(Error::Protocol("the buffers were leaked".into()))),
            }),
        }
    }
}
