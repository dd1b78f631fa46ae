#include "RowCopyPlugin.h"

#include "dhisparse/kernels.h"

namespace dhisparse
{
namespace trt
{

using nvinfer1::DataType;

RowCopyPlugin::RowCopyPlugin(int32_t row_bytes)
    : mRowBytes(row_bytes)
{
    require(row_bytes > 0, "row_bytes must be > 0");
}

RowCopyPlugin RowCopyPlugin::create(nvinfer1::PluginFieldCollection const* fc)
{
    return RowCopyPlugin(FieldReader(fc).get_int32("row_bytes", 0));
}

void RowCopyPlugin::describe_fields(FieldList& fields)
{
    fields.add("row_bytes", static_cast<int32_t const*>(nullptr));
}

void RowCopyPlugin::list_fields(FieldList& fields) const
{
    fields.add("row_bytes", &mRowBytes);
}

int32_t RowCopyPlugin::getNbOutputs() const noexcept
{
    return kNbOutputs;
}

int32_t RowCopyPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* /*inputTypes*/, int32_t nbInputs) const noexcept
{
    if (nbOutputs != kNbOutputs || nbInputs != kNbInputs)
    {
        return -1;
    }
    outputTypes[0] = DataType::kUINT8;
    return 0;
}

int32_t RowCopyPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || inputs[0].nbDims != 2)
    {
        return -1;
    }
    outputs[0] = inputs[0];
    return 0;
}

bool RowCopyPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs)
    {
        return false;
    }
    switch (pos)
    {
    case 0:
    case 4: return is_linear(inOut, pos, DataType::kUINT8);
    case 1: return is_linear(inOut, pos, DataType::kINT64);
    case 2:
    case 3: return is_linear(inOut, pos, DataType::kINT32);
    default: return false;
    }
}

int32_t RowCopyPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || in[0].desc.dims.nbDims != 2)
    {
        return -1;
    }
    int64_t const row_bytes = in[0].desc.dims.d[1];
    return (row_bytes == -1 || row_bytes == mRowBytes) ? 0 : -1;
}

int32_t RowCopyPlugin::getAliasedInput(int32_t outputIndex) noexcept
{
    return outputIndex == 0 ? 0 : -1;
}

int32_t RowCopyPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* /*outputDesc*/, void const* const* inputs, void* const* outputs,
    void* /*workspace*/, cudaStream_t stream) noexcept
{
    cuda::RowCopyArgs const args{nullptr, static_cast<uint64_t const*>(inputs[1]), outputs[0], mRowBytes, inputs[2],
        inputs[3], inputDesc[2].dims.d[0], inputDesc[2].dims.d[1], 4, 0};
    return cuda::launch_row_copy(args, stream) == cudaSuccess ? 0 : -1;
}

} // namespace trt
} // namespace dhisparse
