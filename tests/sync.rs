//! Synchronized batch norm over the in-process thread group (`fusedbn::sync`), 1 to 4
//! ranks: every format and dtype, plain and Ex, uneven and empty shards, several steps
//! of running statistics, the op layer and the Keras-style layer — equal to the
//! single-process ops on the whole batch (bit for bit with one rank) and the same bits
//! on every rank; ranks that disagree get an error, never a hang. The same checks run
//! under `mpirun` in `tests/sync_mpi.rs` (feature `mpi`).

#[path = "common/sync_cases.rs"]
mod sync_cases;

use fusedbn::sync::{Collective, SingleProcess, ThreadGroup, ThreadRank};

/// Runs `f` on every rank of a thread group of `size`, each in its own thread.
fn on_ranks<R: Send>(size: usize, f: impl Fn(&ThreadRank) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let handles: Vec<_> = ThreadGroup::new(size)
            .into_iter()
            .map(|comm| {
                let f = &f;
                s.spawn(move || f(&comm))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn check(size: usize, f: fn(&dyn Collective) -> Result<String, String>) {
    for r in on_ranks(size, |c| f(c)) {
        if let Err(e) = r {
            panic!("{e}");
        }
    }
}

#[test]
fn single_process_is_bit_identical_to_the_whole_ops() {
    sync_cases::all(&SingleProcess).unwrap();
}

#[test]
fn thread_group_of_1() {
    check(1, sync_cases::all);
}

#[test]
fn thread_group_of_2() {
    check(2, sync_cases::all);
}

#[test]
fn thread_group_of_3() {
    check(3, sync_cases::all);
}

#[test]
fn thread_group_of_4() {
    check(4, sync_cases::all);
}

#[test]
fn a_rank_that_leaves_fails_the_others_instead_of_hanging() {
    let results = on_ranks(3, |comm| {
        if comm.rank() == 2 {
            return Ok(Vec::new()); // leaves without taking part
        }
        comm.all_gather(&[1.0])
    });
    for r in &results[..2] {
        let e = r.as_ref().unwrap_err().to_string();
        assert!(e.contains("rank 2 of the thread group"), "{e}");
    }
}

#[test]
fn collectives_are_in_rank_order_and_identical_everywhere() {
    let out = on_ranks(4, |comm| {
        let g = comm.all_gather(&[comm.rank() as f64, 10.0]).unwrap();
        let mut s = vec![0.1 * (comm.rank() + 1) as f64];
        comm.all_reduce_sum(&mut s).unwrap();
        (g, s)
    });
    for (g, s) in &out {
        assert_eq!(g, &[0.0, 10.0, 1.0, 10.0, 2.0, 10.0, 3.0, 10.0]);
        assert_eq!(
            s[0].to_bits(),
            (((0.1 + 0.2) + 0.30000000000000004) + 0.4f64).to_bits()
        );
    }
    // Buffers of different lengths: an error on every rank.
    let out = on_ranks(2, |comm| comm.all_gather(&vec![1.0; comm.rank() + 1]));
    assert!(out.iter().all(|r| r.is_err()));
}
