//! One compiled copy of the kernels, in this crate, whoever calls them.
//!
//! Rust compiles a generic function in every crate that instantiates it (release builds
//! do not share instantiations between crates), so if `Problem::forward::<f32>` were an
//! ordinary generic method, every crate calling it — a user's model, `fusedbn-candle`,
//! `fusedbn-burn`, each test binary — would compile the whole kernel stack beneath it
//! again: about 1 MB of SIMD code, a minute of build time per calling crate on two
//! cores. Instead the public generic methods of [`Problem`] call the methods of
//! [`Mono`], a supertrait of [`Element`] implemented here for the four element types
//! and never inlined: the kernels are instantiated once, when this crate is built, and
//! a caller compiles only a call.
//!
//! There is no crate that does this (it is a property of how the crate's own API is
//! cut), hence the few lines by hand.

use super::phases::{GradSums, Moments};
use super::{
    Affine, Backward, Epilogue, Forward, GradEpilogue, GradInputs, Gradients, Mode, Problem,
    SecondOrderGradients, SecondOrderInputs, Statistics, TrainingStats,
};
use crate::element::Element;
use crate::error::Result;
use half::{bf16, f16};

/// The library's instantiations of the typed API, one per element type (see the
/// module's comment). Not part of the API: [`Element`] is sealed, and these methods are
/// reached through [`Problem`]'s.
#[doc(hidden)]
pub trait Mono: Sized {
    /// [`Problem::forward`].
    fn mono_forward(
        p: &Problem,
        x: &[Self],
        affine: Affine<'_, Self::Stat>,
        mode: Forward<'_, Self::Stat>,
        epilogue: Epilogue<'_, Self>,
        y: &mut [Self],
    ) -> Result<()>
    where
        Self: Element;

    /// [`Problem::backward`].
    fn mono_backward(
        p: &Problem,
        inputs: GradInputs<'_, Self>,
        scale: &[Self::Stat],
        mode: Backward<'_, Self::Stat>,
        epilogue: GradEpilogue<'_, Self>,
        grads: Gradients<'_, Self>,
    ) -> Result<()>
    where
        Self: Element;

    /// [`Problem::second_order`].
    fn mono_second_order(
        p: &Problem,
        inputs: SecondOrderInputs<'_, Self>,
        mode: Mode,
        out: SecondOrderGradients<'_, Self>,
    ) -> Result<()>
    where
        Self: Element;

    /// [`Problem::moments`].
    fn mono_moments(p: &Problem, x: &[Self]) -> Result<Vec<Moments>>
    where
        Self: Element;

    /// [`Problem::forward_apply`].
    fn mono_forward_apply(
        p: &Problem,
        x: &[Self],
        affine: Affine<'_, Self::Stat>,
        moments: &[Moments],
        stats: TrainingStats<'_, Self::Stat>,
        epilogue: Epilogue<'_, Self>,
        y: &mut [Self],
    ) -> Result<()>
    where
        Self: Element;

    /// [`Problem::backward_sums`].
    fn mono_backward_sums(
        p: &Problem,
        inputs: GradInputs<'_, Self>,
        mean: &[Self::Stat],
        epilogue: GradEpilogue<'_, Self>,
    ) -> Result<Vec<GradSums>>
    where
        Self: Element;

    /// [`Problem::backward_apply`].
    fn mono_backward_apply(
        p: &Problem,
        inputs: GradInputs<'_, Self>,
        scale: &[Self::Stat],
        saved: Statistics<'_, Self::Stat>,
        sums: &[GradSums],
        relu_output: Option<&[Self]>,
        grads: Gradients<'_, Self>,
    ) -> Result<()>
    where
        Self: Element;
}

macro_rules! mono {
    ($($t:ty),*) => {$(
        impl Mono for $t {
            #[inline(never)]
            fn mono_forward(
                p: &Problem,
                x: &[Self],
                affine: Affine<'_, <Self as Element>::Stat>,
                mode: Forward<'_, <Self as Element>::Stat>,
                epilogue: Epilogue<'_, Self>,
                y: &mut [Self],
            ) -> Result<()> {
                p.forward_impl(x, affine, mode, epilogue, y)
            }

            #[inline(never)]
            fn mono_backward(
                p: &Problem,
                inputs: GradInputs<'_, Self>,
                scale: &[<Self as Element>::Stat],
                mode: Backward<'_, <Self as Element>::Stat>,
                epilogue: GradEpilogue<'_, Self>,
                grads: Gradients<'_, Self>,
            ) -> Result<()> {
                p.backward_impl(inputs, scale, mode, epilogue, grads)
            }

            #[inline(never)]
            fn mono_second_order(
                p: &Problem,
                inputs: SecondOrderInputs<'_, Self>,
                mode: Mode,
                out: SecondOrderGradients<'_, Self>,
            ) -> Result<()> {
                p.second_order_impl(inputs, mode, out)
            }

            #[inline(never)]
            fn mono_moments(p: &Problem, x: &[Self]) -> Result<Vec<Moments>> {
                p.moments_impl(x)
            }

            #[inline(never)]
            fn mono_forward_apply(
                p: &Problem,
                x: &[Self],
                affine: Affine<'_, <Self as Element>::Stat>,
                moments: &[Moments],
                stats: TrainingStats<'_, <Self as Element>::Stat>,
                epilogue: Epilogue<'_, Self>,
                y: &mut [Self],
            ) -> Result<()> {
                p.forward_apply_impl(x, affine, moments, stats, epilogue, y)
            }

            #[inline(never)]
            fn mono_backward_sums(
                p: &Problem,
                inputs: GradInputs<'_, Self>,
                mean: &[<Self as Element>::Stat],
                epilogue: GradEpilogue<'_, Self>,
            ) -> Result<Vec<GradSums>> {
                p.backward_sums_impl(inputs, mean, epilogue)
            }

            #[inline(never)]
            fn mono_backward_apply(
                p: &Problem,
                inputs: GradInputs<'_, Self>,
                scale: &[<Self as Element>::Stat],
                saved: Statistics<'_, <Self as Element>::Stat>,
                sums: &[GradSums],
                relu_output: Option<&[Self]>,
                grads: Gradients<'_, Self>,
            ) -> Result<()> {
                p.backward_apply_impl(inputs, scale, saved, sums, relu_output, grads)
            }
        }
    )*};
}
mono!(f32, f64, f16, bf16);
