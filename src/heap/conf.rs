//! jemalloc's start-up options (`malloc_conf`): which ones mralloc's heaps want, and the macro
//! that defines them for a program.
//!
//! jemalloc reads its options once, before its first allocation, from a symbol the program may
//! define (`_rjem_malloc_conf` for the jemalloc that tikv-jemalloc-sys builds), then from the
//! `_RJEM_MALLOC_CONF` environment variable. A program has at most one such symbol, so a library
//! must not define it for everyone: mralloc defines it only with its `global` feature (which
//! [`crate::heap`]'s `Global` needs), and otherwise leaves it to the program, through
//! [`malloc_conf!`](crate::malloc_conf) or a definition of its own.

/// The options mralloc's scoped heaps work best with: `disable_large_size_classes:false`, so
/// jemalloc sizes large blocks in classes, four per doubling, as upstream jemalloc does (this
/// build otherwise sizes them by the page).
///
/// The heaps are correct under any options. Without this one, growing a heap in buffers of
/// the same large size takes more registered memory than the buffers use: this jemalloc
/// build, with page-sized large blocks, cuts each block it takes from fresh memory at the next
/// class and leaves the rest behind as a fragment (at 1 MiB, a quarter more; see the README's
/// costs). [`crate::heap::Heap::reserve`] made before the growth avoids it either way.
pub const RECOMMENDED_MALLOC_CONF: &str = crate::__mralloc_recommended_conf!();

#[doc(hidden)]
#[macro_export]
macro_rules! __mralloc_recommended_conf {
    () => {
        "disable_large_size_classes:false"
    };
}

/// Defines jemalloc's start-up options for this program: [`heap::RECOMMENDED_MALLOC_CONF`],
/// followed by the options given (a string literal, jemalloc's `name:value,...` syntax; later
/// options win).
///
/// Use it once, in the binary (not in a library: a program links one such definition), and
/// not together with mralloc's `global` feature, which defines it already (with
/// `oversize_threshold:0`, which `Global` needs). A program that wants other options entirely
/// defines `_rjem_malloc_conf` itself: a `#[no_mangle]` static pointer to a NUL-terminated
/// string.
///
/// ```ignore
/// mralloc::malloc_conf!("dirty_decay_ms:5000");
/// ```
///
/// (Not run as a doc test, which would link a second definition when mralloc is built with
/// `global`: tests/external/tests/macro_conf.rs is a program that uses it.)
///
/// [`heap::RECOMMENDED_MALLOC_CONF`]: crate::heap::RECOMMENDED_MALLOC_CONF
#[macro_export]
macro_rules! malloc_conf {
    () => {
        $crate::__mralloc_define_conf!($crate::__mralloc_recommended_conf!());
    };
    ($options:literal) => {
        $crate::__mralloc_define_conf!(::core::concat!($crate::__mralloc_recommended_conf!(), ",", $options));
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __mralloc_define_conf {
    ($conf:expr) => {
        /// jemalloc's start-up options (read before its first allocation).
        #[no_mangle]
        #[used]
        #[allow(non_upper_case_globals)]
        pub static _rjem_malloc_conf: $crate::heap::MallocConf =
            $crate::heap::MallocConf::__new(::core::concat!($conf, "\0").as_bytes());
    };
}

/// A pointer to jemalloc's start-up options string: the type of the static that
/// [`malloc_conf!`](crate::malloc_conf) defines.
#[repr(transparent)]
pub struct MallocConf(*const libc::c_char);

// SAFETY: points at an immutable, NUL-terminated static string.
unsafe impl Sync for MallocConf {}

impl MallocConf {
    /// For [`malloc_conf!`](crate::malloc_conf): `conf` ends in its only NUL.
    #[doc(hidden)]
    pub const fn __new(conf: &'static [u8]) -> MallocConf {
        let n = conf.len();
        assert!(n >= 2 && conf[n - 1] == 0, "the options string is NUL-terminated and not empty");
        // jemalloc reports (and with `abort_conf:true` aborts on) a string ending in a comma:
        // `malloc_conf!("")` or options with a trailing comma.
        assert!(conf[n - 2] != b',', "the options string must not end with a comma");
        let mut i = 0;
        while i < n - 1 {
            assert!(conf[i] != 0, "the options string has no NUL inside");
            i += 1;
        }
        MallocConf(conf.as_ptr().cast())
    }
}
