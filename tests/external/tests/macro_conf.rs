//! `mralloc::malloc_conf!` in a program built against mralloc's default features: the
//! recommended options and the program's own take effect.

mralloc::malloc_conf!("narenas:2,dirty_decay_ms:2345");

fn opt<T: Copy>(name: &str) -> T {
    let name = format!("opt.{name}\0");
    // SAFETY: each caller names an option of type T.
    unsafe { tikv_jemalloc_ctl::raw::read::<T>(name.as_bytes()) }.unwrap()
}

#[test]
fn the_macro_sets_the_recommended_and_the_programs_options() {
    let heap = mralloc::heap::Heap::builder().build().unwrap();
    drop(heap.alloc(1 << 20).unwrap());
    assert!(!opt::<bool>("disable_large_size_classes"), "the recommended option");
    assert_eq!(opt::<u32>("narenas"), 2);
    assert_eq!(opt::<isize>("dirty_decay_ms"), 2345);
    assert_eq!(
        mralloc::heap::RECOMMENDED_MALLOC_CONF,
        "disable_large_size_classes:false",
        "what the docs promise"
    );
}
