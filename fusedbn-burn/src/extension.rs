//! The backend extension: fusedbn's batch norm as burn backend operations on
//! `Flex`, and on `Autodiff<Flex>` with one backward node per call.
//!
//! `#[backend_extension(Flex, Autodiff)]` generates the `Dispatch` implementation
//! that routes a call to the backend of its tensors; calling these operations on a
//! tensor of any other backend panics, which is why the public functions of this
//! crate ([`crate::batch_norm_train`], [`crate::batch_norm`]) check the device first
//! and take burn's own path elsewhere.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Autodiff, Backend, Flex};

use crate::flex;

/// fusedbn's batch norm as backend operations. Every tensor is `[N, C, *]` (`x`,
/// `output_grad`, the outputs) or `[C]` (the rest).
///
/// The batch statistics come back in the statistics type — `f32` for `f16` and
/// `bf16` data, `x`'s own dtype otherwise — and the backward operations take them
/// as they came, so no rounding sits between the forward pass and its gradient.
/// Gradients of `gamma` and `beta` come back in `gamma`'s dtype.
#[backend_extension(Flex, Autodiff)]
pub trait FusedBatchNormBackend: Backend {
    /// Training forward: `(y, batch_mean, batch_variance)`, the variance biased
    /// (divided by the element count per channel), as burn's `batch_norm_train`.
    fn fusedbn_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// Training gradient: `(dx, dgamma, dbeta)` from the statistics
    /// [`fusedbn_train`](FusedBatchNormBackend::fusedbn_train) returned.
    fn fusedbn_train_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
        output_grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// Inference forward with the given statistics: `y`.
    fn fusedbn_inference(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self>;

    /// Inference gradient: `(dx, dgamma, dbeta)`, the statistics held constant.
    fn fusedbn_inference_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
        output_grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

impl FusedBatchNormBackend for Flex {
    fn fusedbn_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let r = flex::batch_norm_train_stats(x, gamma, beta, epsilon);
        (r.output, r.mean, r.variance)
    }

    fn fusedbn_train_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
        output_grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        flex::backward(x, gamma, mean, variance, epsilon, output_grad, true)
    }

    fn fusedbn_inference(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        flex::batch_norm(x, gamma, beta, mean, variance, epsilon)
    }

    fn fusedbn_inference_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
        output_grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        flex::backward(x, gamma, mean, variance, epsilon, output_grad, false)
    }
}

/// The state a backward node keeps: `x` and `gamma` checkpointed (as burn's own
/// batch-norm node keeps them), the statistics as the forward pass used them.
type State<B> = (NodeId, NodeId, FloatTensor<B>, FloatTensor<B>, f64);

/// One node for the whole op: the gradients of `x`, `gamma` and `beta` from one
/// call of the inner backend's backward operation.
#[derive(Debug)]
struct FusedBatchNormNode {
    training: bool,
}

impl<B: FusedBatchNormBackend> Backward<B, 3> for FusedBatchNormNode {
    type State = State<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_gamma, node_beta] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x_state, gamma_state, mean, variance, epsilon) = ops.state;
        let x = checkpointer.retrieve_node_output::<FloatTensor<B>>(x_state);
        let gamma = checkpointer.retrieve_node_output::<FloatTensor<B>>(gamma_state);
        let (x_grad, gamma_grad, beta_grad) = if self.training {
            B::fusedbn_train_backward(x, gamma, mean, variance, epsilon, grad)
        } else {
            B::fusedbn_inference_backward(x, gamma, mean, variance, epsilon, grad)
        };
        if let Some(node) = node_x {
            grads.register::<B>(node.id, x_grad);
        }
        if let Some(node) = node_gamma {
            grads.register::<B>(node.id, gamma_grad);
        }
        if let Some(node) = node_beta {
            grads.register::<B>(node.id, beta_grad);
        }
    }
}

impl<B: FusedBatchNormBackend, C: CheckpointStrategy> FusedBatchNormBackend for Autodiff<B, C> {
    fn fusedbn_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let node = FusedBatchNormNode { training: true };
        match node
            .prepare::<C>([x.node(), gamma.node(), beta.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let x_state = prep.checkpoint(&x);
                let gamma_state = prep.checkpoint(&gamma);
                let (y, mean, variance) = B::fusedbn_train(
                    x.into_primitive(),
                    gamma.into_primitive(),
                    beta.into_primitive(),
                    epsilon,
                );
                let state = (
                    x_state,
                    gamma_state,
                    mean.clone(),
                    variance.clone(),
                    epsilon,
                );
                (
                    prep.finish(state, y),
                    <FloatTensor<Self>>::new(mean),
                    <FloatTensor<Self>>::new(variance),
                )
            }
            OpsKind::UnTracked(prep) => {
                let (y, mean, variance) = B::fusedbn_train(
                    x.into_primitive(),
                    gamma.into_primitive(),
                    beta.into_primitive(),
                    epsilon,
                );
                (
                    prep.finish(y),
                    <FloatTensor<Self>>::new(mean),
                    <FloatTensor<Self>>::new(variance),
                )
            }
        }
    }

    fn fusedbn_train_backward(
        _x: FloatTensor<Self>,
        _gamma: FloatTensor<Self>,
        _mean: FloatTensor<Self>,
        _variance: FloatTensor<Self>,
        _epsilon: f64,
        _output_grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        panic!("fusedbn-burn: the batch-norm gradient is not differentiable (no second order)")
    }

    fn fusedbn_inference(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        let node = FusedBatchNormNode { training: false };
        let (mean, variance) = (mean.into_primitive(), variance.into_primitive());
        match node
            .prepare::<C>([x.node(), gamma.node(), beta.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let x_state = prep.checkpoint(&x);
                let gamma_state = prep.checkpoint(&gamma);
                let y = B::fusedbn_inference(
                    x.into_primitive(),
                    gamma.into_primitive(),
                    beta.into_primitive(),
                    mean.clone(),
                    variance.clone(),
                    epsilon,
                );
                prep.finish((x_state, gamma_state, mean, variance, epsilon), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fusedbn_inference(
                x.into_primitive(),
                gamma.into_primitive(),
                beta.into_primitive(),
                mean,
                variance,
                epsilon,
            )),
        }
    }

    fn fusedbn_inference_backward(
        _x: FloatTensor<Self>,
        _gamma: FloatTensor<Self>,
        _mean: FloatTensor<Self>,
        _variance: FloatTensor<Self>,
        _epsilon: f64,
        _output_grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        panic!("fusedbn-burn: the batch-norm gradient is not differentiable (no second order)")
    }
}
