//! The [`Collective`] over an MPI communicator (rsmpi), behind the cargo feature `mpi`.

use mpi::topology::Communicator;
use mpi::traits::CommunicatorCollectives;

use super::Collective;
use crate::error::Result;

/// The ranks of an MPI communicator (any rsmpi [`Communicator`]: the world, or a
/// split of it) as a [`Collective`].
///
/// `all_gather` is `MPI_Allgather`; `all_reduce_sum` is an `MPI_Allgather` followed by
/// a sum in rank order on every rank, rather than `MPI_Allreduce`, whose reduction
/// order is the implementation's choice and need not give the same bits on every
/// rank. (A gradient sends `2·C + 1` values, so the gather costs no more than the
/// latency of one collective.)
///
/// rsmpi aborts the job on an MPI error (`MPI_ERRORS_ARE_FATAL`); every other
/// failure is an [`Error`](crate::Error). MPI itself is initialized by the caller:
///
/// ```no_run
/// use fusedbn::sync::{mpi, Collective, Mpi};
/// let universe = mpi::initialize().expect("MPI initialized twice");
/// let comm = Mpi::new(universe.world());
/// println!("rank {} of {}", comm.rank(), comm.size());
/// ```
///
/// Run it with `mpirun -n 4 <program>`.
#[derive(Debug)]
pub struct Mpi<C: Communicator> {
    comm: C,
}

impl<C: Communicator> Mpi<C> {
    /// Wraps `comm`.
    pub fn new(comm: C) -> Self {
        Mpi { comm }
    }

    /// The wrapped communicator.
    pub fn communicator(&self) -> &C {
        &self.comm
    }
}

impl<C: Communicator> Collective for Mpi<C> {
    fn rank(&self) -> usize {
        self.comm.rank() as usize
    }

    fn size(&self) -> usize {
        self.comm.size() as usize
    }

    fn all_gather(&self, local: &[f64]) -> Result<Vec<f64>> {
        let mut out = vec![0.0f64; local.len() * self.size()];
        self.comm.all_gather_into(local, &mut out[..]);
        Ok(out)
    }
}
